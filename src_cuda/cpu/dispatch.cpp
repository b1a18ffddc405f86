// Chooses, once, which compiled variant of the CPU kernels registers as minipaged's CPU kernels:
// the best one this CPU supports, or the one MINIPAGED_CPU_ISA names. Compiled with the
// architecture's default flags only, like everything outside the per-variant objects.
#include "cpu/dispatch.h"

#include <cstdlib>
#include <map>
#include <stdexcept>
#include <string>
#include <vector>

#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace minipaged::cpu_dispatch {
namespace {

bool cpu_has(const char* isa) {
  const std::string name = isa;
  if (name == "scalar" || name == "native") return true;  // native: built for this very machine
#if defined(__x86_64__) || defined(_M_X64)
  __builtin_cpu_init();
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
  const bool avx512 = avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                      __builtin_cpu_supports("avx512vl");
  if (name == "avx2") return avx2;
  if (name == "avx512") return avx512;
  // Every CPU with AVX512-BF16 so far has AVX512-VNNI too (int8 caches use its 16-bit dot products);
  // all but Cooper Lake have AVX512-VBMI (fp8 caches look their bytes up with it), which then takes avx512.
  const bool avx512_bf16 = avx512 && __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512vnni") &&
                           __builtin_cpu_supports("avx512vbmi");
  if (name == "avx512_bf16") return avx512_bf16;
  if (name == "avx512_amx")
    return avx512_bf16 && __builtin_cpu_supports("amx-tile") && __builtin_cpu_supports("amx-bf16") && os_allows_amx();
#endif
  return false;
}

// Every variant the build may compile, worst first; the best supported compiled one wins.
constexpr const char* kPreference[] = {"scalar", "avx2", "avx512", "avx512_bf16", "avx512_amx", "native"};

std::map<std::string, std::vector<RegisterKernels>>& registry() {
  static std::map<std::string, std::vector<RegisterKernels>> variants;
  return variants;
}

std::string& chosen() {
  static std::string isa;
  return isa;
}

std::string join(const std::vector<std::string>& names) {
  std::string out;
  for (const auto& n : names) out += (out.empty() ? "" : ", ") + n;
  return out;
}

}  // namespace

// Linux hands out the AMX tile state (8 KiB per thread) only to processes that ask for it; the
// answer holds for every thread of the process.
bool os_allows_amx() {
#if defined(__linux__) && defined(SYS_arch_prctl)
  constexpr int kRequestPermission = 0x1023, kTileData = 18;  // ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA
  static const bool allowed = syscall(SYS_arch_prctl, kRequestPermission, kTileData) == 0;
  return allowed;
#else
  return false;
#endif
}

bool add_kernels(const char* isa, RegisterKernels fn) {
  registry()[isa].push_back(fn);
  return true;
}

std::vector<std::string> compiled_isas() {
  std::vector<std::string> out;
  for (const char* isa : kPreference)
    if (registry().count(isa)) out.push_back(isa);
  return out;
}

std::vector<std::string> supported_isas() {
  std::vector<std::string> out;
  for (const auto& isa : compiled_isas())
    if (cpu_has(isa.c_str())) out.push_back(isa);
  return out;
}

std::string cpu_isa() { return chosen(); }

void register_cpu_kernels() {
  if (!chosen().empty()) return;  // a second PyInit after a failed first import
  const std::vector<std::string> supported = supported_isas();
  if (supported.empty()) throw std::runtime_error("minipaged: no compiled CPU kernel variant runs on this CPU");
  std::string isa = supported.back();
  const char* forced = std::getenv("MINIPAGED_CPU_ISA");
  if (forced != nullptr && *forced != '\0') {
    isa = forced;
    bool known = false;
    std::vector<std::string> per_isa;  // the names the message offers; native is named apart
    for (const char* name : kPreference) {
      known = known || isa == name;
      if (std::string(name) != "native") per_isa.push_back(name);
    }
    if (!known)
      throw std::invalid_argument("MINIPAGED_CPU_ISA='" + isa + "': expected one of " + join(per_isa) +
                                  " (or native in a MINIPAGED_NATIVE_CPU build)");
    if (!registry().count(isa))
      throw std::invalid_argument("MINIPAGED_CPU_ISA=" + isa + ": this build did not compile that variant (compiled: " +
                                  join(compiled_isas()) + ")");
    if (!cpu_has(isa.c_str()))
      throw std::invalid_argument("MINIPAGED_CPU_ISA=" + isa + ": this CPU lacks the instructions it needs "
                                  "(usable here: " + join(supported) + ")");
  }
  // Lives as long as the process, like a TORCH_LIBRARY_IMPL block's static library.
  auto* library = new torch::Library(torch::Library::IMPL, "minipaged", c10::DispatchKey::CPU, __FILE__, __LINE__);
  for (RegisterKernels fn : registry().at(isa)) fn(*library);
  chosen() = isa;
}

}  // namespace minipaged::cpu_dispatch
