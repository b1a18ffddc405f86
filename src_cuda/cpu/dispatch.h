// Load-time choice among the per-instruction-set builds of the CPU kernels (see cpu/isa.h).
#pragma once
#include <torch/library.h>

#include <string>
#include <vector>

namespace minipaged::cpu_dispatch {
using RegisterKernels = void (*)(torch::Library&);
// Remembers a variant's registration function (MINIPAGED_CPU_IMPL calls it at static init).
bool add_kernels(const char* isa, RegisterKernels fn);
// Registers the chosen variant's kernels; throws std::invalid_argument for a bad
// MINIPAGED_CPU_ISA. Called from _C's module init, after every variant has added itself.
void register_cpu_kernels();
std::string cpu_isa();                     // the variant in use; empty before registration
std::vector<std::string> compiled_isas();  // worst first
std::vector<std::string> supported_isas(); // compiled and runnable on this CPU, worst first
// Whether the OS lets this process use AMX tiles (asked once; Linux only). The kernels check it
// too, since a -march=native build may use AMX without the avx512_amx variant being chosen.
bool os_allows_amx();
}  // namespace minipaged::cpu_dispatch
