// The scheduler behind cuda_emu.h: one fiber per CUDA thread, switched by a hand-written x86-64
// context switch (swapcontext saves the signal mask with a system call on every switch, and a
// decode block switches hundreds of thousands of times).
//
// EMU_SCHEDULE picks how the threads of a block interleave between yields (see Schedule below):
// `lockstep` rounds (the default; EMU_SEED shuffles each round), `random` (the default when
// EMU_SEED is set: one random warp at a time, so warps drift any number of shuffles apart) and
// `warp_ahead` (each warp runs to its next barrier alone, last warp first: the widest skew).
// A barrier missing between two warps' uses of shared memory then gives a wrong result without
// a sanitizer; one missing between lanes of one warp whose accesses a full-warp shuffle already
// orders in execution (not in CUDA's memory model) is left to TSan, where shuffles order nothing.
//
// Under TSan this file is built with the TSan fiber API but without instrumentation: its own
// bookkeeping (a fiber's state, read by the scheduler) is not kernel data, and the switches carry
// no happens-before. The edges it does create are the ones CUDA guarantees: the host's writes
// before a launch are visible to every thread, each thread's writes are visible to the host after
// it, and the threads of one block are ordered at each __syncthreads. Blocks are not ordered among
// themselves, but thread t of every block is the same TSan fiber (creating fibers per block costs
// more than the kernels), so only a race between different thread indices of two blocks shows.
#include "emulation/cuda_emu.h"

#include <sys/mman.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <random>
#include <string>
#include <vector>

#if defined(EMU_TSAN_API)
#include <sanitizer/tsan_interface.h>
#endif
#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/asan_interface.h>
#define EMU_ASAN 1
#endif

// switch_stack(save, next): pushes the callee-saved registers and the SSE/x87 control words,
// stores the stack pointer in *save, loads `next` and pops the same from there.
extern "C" void emu_switch_stack(void** save, void* next);
asm(R"(
  .text
  .globl emu_switch_stack
  .hidden emu_switch_stack
  .type emu_switch_stack,@function
emu_switch_stack:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  subq $8, %rsp
  stmxcsr (%rsp)
  fnstcw 4(%rsp)
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  ldmxcsr (%rsp)
  fldcw 4(%rsp)
  addq $8, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .size emu_switch_stack, .-emu_switch_stack
)");

namespace emu {
namespace {

enum class State { kReady, kAtBarrier, kAtShuffle, kDone };

struct Fiber {
  void* stack_pointer = nullptr;
  char* stack = nullptr;  // usable part, above a guard page
  size_t stack_size = 0;
  uint3 thread{};
  int lane = 0;
  State state = State::kDone;
  int line = 0;           // source line of the barrier or shuffle it waits at
  unsigned mask = 0;      // shuffle: the lanes taking part
  int src_lane = 0;       // shuffle: whose value it reads
  uint64_t value = 0;     // shuffle: its value in, the source's value out
  unsigned barriers = 0;  // barriers passed in this block
  void* tsan_fiber = nullptr;
};

struct Block {
  std::vector<Fiber> fibers;
  void* scheduler_stack_pointer = nullptr;
  void (*body)(void*) = nullptr;
  void* context = nullptr;
  uint3 index{};
  dim3 block_dim, grid_dim;
  unsigned char* shared = nullptr;
  std::vector<std::pair<const void*, std::unique_ptr<unsigned char[]>>> static_shared;  // per declaration
  std::string problem;  // the first misuse seen; the launch fails with it
  void* tsan_scheduler = nullptr;
  // Sync objects for TSan: heap memory, so that freeing them forgets their clocks.
  std::unique_ptr<char[]> tsan_sync{new char[4]};  // [0..1] barriers (alternating), [2] launch start, [3] exit
#if EMU_ASAN
  const void* scheduler_stack_bottom = nullptr;
  size_t scheduler_stack_size = 0;
#endif
};

thread_local Block* current_block = nullptr;
thread_local Fiber* current_fiber = nullptr;
thread_local cudaError_t last_error = cudaSuccess;
thread_local std::string last_problem;
long problem_count = 0;

void fill_with_nan(unsigned char* p, size_t bytes) {
  for (size_t i = 0; i + 4 <= bytes; i += 4) {
    const uint32_t nan = 0x7FC0DEADu;  // a quiet NaN: a read of unwritten shared memory shows
    std::memcpy(p + i, &nan, 4);
  }
}

[[noreturn]] void fatal(const char* what) {
  std::fprintf(stderr, "cuda_emu: %s\n", what);
  std::abort();
}

// Records a misuse that is undefined or hangs on a GPU; the launch then fails with it.
void report(Block& b, const std::string& what) {
  ++problem_count;
  if (b.problem.empty()) {
    char where[96];
    std::snprintf(where, sizeof where, " (block %u,%u,%u)", b.index.x, b.index.y, b.index.z);
    b.problem = what + where;
    std::fprintf(stderr, "cuda_emu: %s\n", b.problem.c_str());
  }
  if (std::getenv("EMU_ABORT")) std::abort();  // for a debugger or a sanitizer's stack trace
}

std::string format(const char* fmt, long a, long b = 0, long c = 0, long d = 0) {
  char text[256];
  std::snprintf(text, sizeof text, fmt, a, b, c, d);
  return text;
}

void tsan_release(void* addr) {
#if defined(EMU_TSAN_API)
  __tsan_release(addr);
#else
  (void)addr;
#endif
}
void tsan_acquire(void* addr) {
#if defined(EMU_TSAN_API)
  __tsan_acquire(addr);
#else
  (void)addr;
#endif
}
void tsan_switch(void* fiber) {
#if defined(EMU_TSAN_API)
  __tsan_switch_to_fiber(fiber, __tsan_switch_to_fiber_no_sync);
#else
  (void)fiber;
#endif
}

// From the running fiber back to the scheduler; `exiting` when it will never be resumed.
void yield_to_scheduler(bool exiting) {
  Block* b = current_block;
  Fiber* f = current_fiber;
#if EMU_ASAN
  void* fake_stack = nullptr;
  __sanitizer_start_switch_fiber(exiting ? nullptr : &fake_stack, b->scheduler_stack_bottom, b->scheduler_stack_size);
#endif
  (void)exiting;
  tsan_switch(b->tsan_scheduler);
  emu_switch_stack(&f->stack_pointer, b->scheduler_stack_pointer);
#if EMU_ASAN
  __sanitizer_finish_switch_fiber(fake_stack, nullptr, nullptr);
#endif
}

extern "C" void emu_fiber_entry() {
  Block* b = current_block;
#if EMU_ASAN
  __sanitizer_finish_switch_fiber(nullptr, &b->scheduler_stack_bottom, &b->scheduler_stack_size);
#endif
  tsan_acquire(&b->tsan_sync[2]);  // the host's writes before the launch
  b->body(b->context);
  tsan_release(&b->tsan_sync[3]);  // this thread's writes, for the host after the launch
  current_fiber->state = State::kDone;
  yield_to_scheduler(true);
  fatal("a finished fiber was resumed");
}

void resume(Block& b, Fiber& f) {
  current_fiber = &f;
#if EMU_ASAN
  void* fake_stack = nullptr;
  __sanitizer_start_switch_fiber(&fake_stack, f.stack, f.stack_size);
#endif
  tsan_switch(f.tsan_fiber);
  emu_switch_stack(&b.scheduler_stack_pointer, f.stack_pointer);
#if EMU_ASAN
  __sanitizer_finish_switch_fiber(fake_stack, nullptr, nullptr);
#endif
  current_fiber = nullptr;
}

// A fresh stack whose first switch "returns" into emu_fiber_entry with default control words.
void prepare(Fiber& f) {
#if EMU_ASAN
  __asan_unpoison_memory_region(f.stack, f.stack_size);  // frames a previous fiber left poisoned
#endif
  uint64_t* top = reinterpret_cast<uint64_t*>(f.stack + f.stack_size);
  top[-1] = 0;  // keeps the entry's frame 16-byte aligned as after a call
  top[-2] = reinterpret_cast<uint64_t>(&emu_fiber_entry);
  for (int i = 3; i <= 8; ++i) top[-i] = 0;  // rbp rbx r12..r15
  const uint32_t control[2] = {0x1F80, 0x037F};  // MXCSR and x87 control word at reset
  std::memcpy(&top[-9], control, sizeof control);
  f.stack_pointer = &top[-9];
  f.state = State::kReady;
  f.barriers = 0;
}

// Fiber stacks, mapped once per OS thread and reused: 256 KiB each below a guard page.
struct StackPool {
  static constexpr size_t kSize = size_t{1} << 18, kGuard = 4096;
  std::vector<char*> stacks;
  char* get(size_t i) {
    while (stacks.size() <= i) {
      void* p = mmap(nullptr, kSize + kGuard, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_STACK, -1, 0);
      if (p == MAP_FAILED) fatal("mmap of a fiber stack failed");
      mprotect(p, kGuard, PROT_NONE);  // a stack overflow faults instead of corrupting a neighbour
      stacks.push_back(static_cast<char*>(p) + kGuard);
    }
    return stacks[i];
  }
};
thread_local StackPool stack_pool;

#if defined(EMU_TSAN_API)
// One TSan fiber per thread index, created once per OS thread and kept.
void* tsan_fiber(size_t i) {
  thread_local std::vector<void*> fibers;
  while (fibers.size() <= i) fibers.push_back(__tsan_create_fiber(0));
  return fibers[i];
}
#endif

// Exchanges the values of a warp whose lanes all wait at a shuffle; false if none is released.
bool release_warp(Block& b, int warp) {
  const int n = static_cast<int>(b.fibers.size());
  Fiber* lanes[32] = {};
  unsigned mask = 0;
  bool any = false;
  for (int l = 0; l < 32 && warp * 32 + l < n; ++l) {
    lanes[l] = &b.fibers[warp * 32 + l];
    if (lanes[l]->state == State::kAtShuffle && !any) mask = lanes[l]->mask, any = true;
  }
  if (!any) return false;
  for (int l = 0; l < 32; ++l) {
    Fiber* f = lanes[l];
    if (f && f->state == State::kAtShuffle && f->mask != mask)
      report(b, format("lanes of warp %ld disagree on a shuffle's mask (0x%lx at line %ld, 0x%lx)", warp, f->mask,
                       f->line, mask));
    if (f && f->state == State::kAtShuffle && !(mask >> l & 1u))
      report(b, format("lane %ld of warp %ld waits at a shuffle (line %ld) whose mask 0x%lx leaves it out", l, warp,
                       f->line, mask));
    if (!(mask >> l & 1u)) continue;
    if (!f || f->state == State::kDone)
      report(b, format("a shuffle with mask 0x%lx names lane %ld of warp %ld, which has exited", mask, l, warp));
    else if (f->state == State::kAtBarrier)
      report(b, format("lane %ld of warp %ld waits at __syncthreads (line %ld) while its warp shuffles", l, warp,
                       f->line));
  }
  if (!b.problem.empty()) return false;
  uint64_t values[32] = {};
  for (int l = 0; l < 32; ++l)
    if (lanes[l]) values[l] = lanes[l]->value;
  for (int l = 0; l < 32; ++l) {
    if (!(mask >> l & 1u)) continue;
    Fiber& f = *lanes[l];
    if (f.src_lane < 0 || f.src_lane > 31 || !(mask >> f.src_lane & 1u)) {
      report(b, format("lane %ld reads lane %ld, outside the shuffle's mask 0x%lx (line %ld)", l, f.src_lane, mask,
                       f.line));
      return false;
    }
    f.value = values[f.src_lane];
    f.state = State::kReady;
  }
  return true;
}

// How the scheduler interleaves the threads of a block between their yields (EMU_SCHEDULE).
//   lockstep    rounds: every ready thread runs to its next yield, in thread order (with EMU_SEED
//               in a fresh random order each round); then the shuffles and barriers are released.
//               No warp gets more than one shuffle ahead of another.
//   random      (the default when EMU_SEED is set) one warp at a time: a warp picked at random
//               among those that can move runs its ready lanes (in random order) to their next
//               yield, and its shuffle is released as soon as all its lanes wait there, so a warp
//               can pass any number of shuffles while the others stand still: a random walk of
//               warp skews between barriers.
//   warp_ahead  deterministic worst skew: the last warp that can move runs until every lane of
//               it waits at a barrier or has exited, then the one before it, and so on; the last
//               warp finishes a barrier interval before warp 0 starts it.
// Barriers release only when every thread of the block waits at one, in every schedule.
enum class Schedule { kLockstep, kRandom, kWarpAhead };

// Runs the ready lanes of `warp` to their next yield, then releases its shuffle if all its lanes
// wait there; true if the warp can move again.
bool step_warp(Block& b, int warp, std::mt19937* lane_order) {
  const int n = static_cast<int>(b.fibers.size());
  int lanes[32], count = 0;
  for (int l = 0; l < 32 && warp * 32 + l < n; ++l) lanes[count++] = warp * 32 + l;
  if (lane_order) std::shuffle(lanes, lanes + count, *lane_order);
  for (int i = 0; i < count; ++i)
    if (b.fibers[lanes[i]].state == State::kReady) resume(b, b.fibers[lanes[i]]);
  return release_warp(b, warp);
}

bool warp_ready(const Block& b, int warp) {
  const int n = static_cast<int>(b.fibers.size());
  for (int t = warp * 32; t < n && t < warp * 32 + 32; ++t)
    if (b.fibers[t].state == State::kReady) return true;
  return false;
}

// Runs one block to completion, or until the first misuse.
void run_block(Block& b, Schedule schedule, std::mt19937* rng) {
  const int n = static_cast<int>(b.fibers.size()), warps = (n + 31) / 32;
  std::vector<int> order(n), movable;
  for (int i = 0; i < n; ++i) order[i] = i;
  for (Fiber& f : b.fibers) prepare(f);
  for (;;) {
    if (schedule == Schedule::kLockstep) {
      if (rng) std::shuffle(order.begin(), order.end(), *rng);
      for (int i : order)
        if (b.fibers[i].state == State::kReady) resume(b, b.fibers[i]);
      // Every fiber now waits at a barrier or a shuffle, or has finished. Shuffles go first: a
      // barrier releases only when no thread waits anywhere else.
      bool released = false;
      for (int w = 0; w < warps && b.problem.empty(); ++w) released |= release_warp(b, w);
      if (!b.problem.empty()) return;
      if (released) continue;
    } else {
      // Until no warp can move: every lane waits at a barrier or has exited.
      for (;;) {
        movable.clear();
        for (int w = 0; w < warps; ++w)
          if (warp_ready(b, w)) movable.push_back(w);
        if (movable.empty()) break;
        if (schedule == Schedule::kWarpAhead) {
          const int w = movable.back();
          while (step_warp(b, w, nullptr) && b.problem.empty()) {
          }
        } else {
          step_warp(b, movable[std::uniform_int_distribution<size_t>(0, movable.size() - 1)(*rng)], rng);
        }
        if (!b.problem.empty()) return;
      }
    }
    int done = 0, waiting = 0, line = -1;
    for (Fiber& f : b.fibers) {
      if (f.state == State::kDone) ++done;
      if (f.state != State::kAtBarrier) continue;
      ++waiting;
      if (line < 0) line = f.line;
      if (f.line != line) report(b, format("threads wait at two different __syncthreads (lines %ld and %ld)", line, f.line));
    }
    if (done == n) return;
    if (done > 0)
      report(b, format("%ld threads exited while %ld wait at __syncthreads (line %ld)", done, waiting, line));
    if (!b.problem.empty()) return;
    for (Fiber& f : b.fibers)
      if (f.state == State::kAtBarrier) f.state = State::kReady;
  }
}

unsigned seed_from_env() {
  const char* s = std::getenv("EMU_SEED");
  return s ? static_cast<unsigned>(std::strtoul(s, nullptr, 10)) : 0;
}

Schedule schedule_from_env() {
  const char* s = std::getenv("EMU_SCHEDULE");
  if (!s || !*s) return std::getenv("EMU_SEED") ? Schedule::kRandom : Schedule::kLockstep;
  const std::string name = s;
  if (name == "lockstep") return Schedule::kLockstep;
  if (name == "random") return Schedule::kRandom;
  if (name == "warp_ahead") return Schedule::kWarpAhead;
  fatal("EMU_SCHEDULE must be lockstep, random or warp_ahead");
}

bool launchable(const LaunchConfig& c) {
  const uint64_t threads = uint64_t{c.block.x} * c.block.y * c.block.z;
  return c.grid.x > 0 && c.grid.y > 0 && c.grid.z > 0 && c.grid.x <= 0x7FFFFFFFu && c.grid.y <= 65535 &&
         c.grid.z <= 65535 && threads > 0 && threads <= 1024 && c.block.x <= 1024 && c.block.y <= 1024 &&
         c.block.z <= 64;
}

}  // namespace

void run_grid(const LaunchConfig& c, void (*body)(void*), void* context) {
  if (current_block) fatal("a kernel launched another kernel (dynamic parallelism is not emulated)");
  if (!launchable(c)) {
    last_error = cudaErrorInvalidConfiguration;
    return;
  }
  if (c.shared_bytes > 48 * 1024) {  // more needs cudaFuncSetAttribute, which the kernels do not call
    last_error = cudaErrorInvalidValue;
    return;
  }
  const unsigned seed = seed_from_env();  // read per launch, so a test can vary it
  const Schedule schedule = schedule_from_env();
  std::mt19937 rng(seed);
  const size_t threads = size_t{c.block.x} * c.block.y * c.block.z;
  // Exactly the bytes the launch asked for, so that ASan reports a read past them.
  std::unique_ptr<unsigned char[]> shared(new unsigned char[c.shared_bytes ? c.shared_bytes : 1]);
  Block b;
  b.body = body;
  b.context = context;
  b.block_dim = c.block;
  b.grid_dim = c.grid;
  b.shared = c.shared_bytes ? shared.get() : nullptr;
  b.fibers.resize(threads);
  for (size_t t = 0; t < threads; ++t) {
    Fiber& f = b.fibers[t];
    f.stack = stack_pool.get(t);
    f.stack_size = StackPool::kSize;
    f.lane = static_cast<int>(t % 32);
    f.thread = uint3{static_cast<unsigned>(t % c.block.x), static_cast<unsigned>(t / c.block.x % c.block.y),
                     static_cast<unsigned>(t / (size_t{c.block.x} * c.block.y))};
  }
#if defined(EMU_TSAN_API)
  b.tsan_scheduler = __tsan_get_current_fiber();
#endif
  current_block = &b;
  tsan_release(&b.tsan_sync[2]);
  for (unsigned z = 0; z < c.grid.z && b.problem.empty(); ++z)
    for (unsigned y = 0; y < c.grid.y && b.problem.empty(); ++y)
      for (unsigned x = 0; x < c.grid.x && b.problem.empty(); ++x) {
        b.index = uint3{x, y, z};
        fill_with_nan(shared.get(), c.shared_bytes);
        b.static_shared.clear();
#if defined(EMU_TSAN_API)
        // Fresh barrier objects per block: nothing orders two blocks of a grid.
        for (size_t t = 0; t < threads; ++t) b.fibers[t].tsan_fiber = tsan_fiber(t);
        b.tsan_sync.reset(new char[4]);
        tsan_release(&b.tsan_sync[2]);
#endif
        run_block(b, schedule, schedule == Schedule::kRandom || seed ? &rng : nullptr);
        tsan_acquire(&b.tsan_sync[3]);
      }
  current_block = nullptr;
  if (!b.problem.empty()) {
    last_problem = b.problem;
    last_error = cudaErrorLaunchFailure;
  }
}

const uint3& thread_idx() {
  if (!current_fiber) fatal("threadIdx read outside a kernel");
  return current_fiber->thread;
}
const uint3& block_idx() { return current_block->index; }
const dim3& block_dim() { return current_block->block_dim; }
const dim3& grid_dim() { return current_block->grid_dim; }
int lane_id() { return current_fiber->lane; }
unsigned char* dynamic_shared_memory() { return current_block->shared; }

void* static_shared(const void* site, size_t bytes) {
  auto& arrays = current_block->static_shared;
  for (auto& [s, array] : arrays)
    if (s == site) return array.get();
  arrays.emplace_back(site, new unsigned char[bytes]);
  fill_with_nan(arrays.back().second.get(), bytes);
  return arrays.back().second.get();
}

void sync_threads(int line) {
  Block* b = current_block;
  Fiber* f = current_fiber;
  f->state = State::kAtBarrier;
  f->line = line;
  tsan_release(&b->tsan_sync[f->barriers & 1]);
  yield_to_scheduler(false);
  tsan_acquire(&b->tsan_sync[f->barriers & 1]);
  ++f->barriers;
}

uint64_t shuffle(unsigned mask, uint64_t bits, int src_lane, int line) {
  Fiber* f = current_fiber;
  f->state = State::kAtShuffle;
  f->line = line;
  f->mask = mask;
  f->src_lane = src_lane;
  f->value = bits;
  yield_to_scheduler(false);  // no happens-before: a shuffle moves a register, not memory
  return f->value;
}

cudaError_t get_last_error() {
  const cudaError_t e = last_error;
  last_error = cudaSuccess;
  return e;
}

const char* error_string(cudaError_t error) {
  switch (error) {
    case cudaSuccess: return "no error";
    case cudaErrorInvalidConfiguration: return "invalid configuration argument";
    case cudaErrorInvalidValue: return "invalid argument";
    case cudaErrorLaunchFailure: return last_problem.c_str();
    default: return "unexpected error code";
  }
}

cudaError_t device_attribute(int* value, cudaDeviceAttr attribute, int) {
  // An H100/H200: the split-K sizing sees the SM count of the GPU it targets.
  if (attribute != cudaDevAttrMultiProcessorCount) return cudaErrorInvalidValue;
  *value = 132;
  return cudaSuccess;
}

long problems_reported() { return problem_count; }

}  // namespace emu
