// cuda_emu.h: the CUDA features the kernels in src_cuda/cuda/ use, emulated on the host CPU so
// that their unchanged source runs (and is checked) on a machine without a GPU.
//
// Pre-included (g++ -include) into a .cu file after cu_to_cpp.py rewrote its two pieces of
// CUDA-only syntax: `kernel<<<grid, block, smem, stream>>>(args)` and `extern __shared__ T x[];`.
//
// Model (runtime.cpp): the blocks of a grid run one after another on the calling thread. Each CUDA
// thread of a block is a fiber with its own stack; a fiber runs until it reaches __syncthreads or a
// warp shuffle, the only points where it yields. The scheduler reports what a GPU would leave
// undefined or hang on: a shuffle naming a lane that exited or waits elsewhere, lanes disagreeing
// on the mask, threads of a block at different barriers, a barrier some threads never reach.
// A launch past the limits of compute capability 9.0 fails with CUDA's error code; dynamic shared
// memory has exactly the requested size and starts NaN-filled. EMU_SCHEDULE (lockstep, random,
// warp_ahead) and EMU_SEED=n pick the order of the fibers between sync points (runtime.cpp). Under -fsanitize=address the fiber stacks are annotated;
// under -fsanitize=thread the fibers are TSan fibers and barriers the only happens-before edges.
//
// What it cannot show: races between blocks (they never overlap), weak memory ordering, nvcc's
// code generation (the host compiler builds this), stream asynchrony, and anything about speed.
#pragma once
#include <cuda_runtime.h>  // host-compilable parts only: dim3, uint4, float2, cudaError_t
#include <cuda_bf16.h>     // the conversions are __host__ __device__ and work on the host
#include <cuda_fp16.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <tuple>

#ifndef __launch_bounds__
#define __launch_bounds__(...)
#endif

namespace emu {

struct LaunchConfig {
  dim3 grid, block;
  size_t shared_bytes;
};
inline LaunchConfig config(dim3 grid, dim3 block, size_t shared_bytes = 0, cudaStream_t = nullptr) {
  return {grid, block, shared_bytes};
}

// Runs `body(context)` once per CUDA thread of the grid, or records cudaErrorInvalidConfiguration
// (cudaErrorInvalidValue for shared memory) when the configuration would not launch on a GPU.
void run_grid(const LaunchConfig& config, void (*body)(void*), void* context);

// kernel<<<config>>>(args...): arguments are copied once, as CUDA copies kernel parameters.
template <class Kernel, class... Args>
void launch(const LaunchConfig& config, Kernel kernel, Args... args) {
  struct Call {
    Kernel* kernel;
    std::tuple<Args...>* args;
  };
  std::tuple<Args...> copied(args...);
  Call call{&kernel, &copied};
  run_grid(config, [](void* p) { auto* c = static_cast<Call*>(p); std::apply(*c->kernel, *c->args); }, &call);
}

// The running fiber's view of the launch.
const uint3& thread_idx();
const uint3& block_idx();
const dim3& block_dim();
const dim3& grid_dim();
int lane_id();
unsigned char* dynamic_shared_memory();
template <class T>
T* dynamic_shared() { return reinterpret_cast<T*>(dynamic_shared_memory()); }
// `__shared__ T x[N];`: one NaN-filled array per thread block for each declaration `site`.
void* static_shared(const void* site, size_t bytes);

void sync_threads(int line);
uint64_t shuffle(unsigned mask, uint64_t bits, int src_lane, int line);

// The CUDA runtime calls the launch code makes, answered by the emulator.
cudaError_t get_last_error();
const char* error_string(cudaError_t error);
cudaError_t device_attribute(int* value, cudaDeviceAttr attribute, int device);

// Misuse of barriers and shuffles the scheduler reported since the process started.
long problems_reported();

}  // namespace emu

#define threadIdx (::emu::thread_idx())
#define blockIdx (::emu::block_idx())
#define blockDim (::emu::block_dim())
#define gridDim (::emu::grid_dim())
#define cudaGetLastError ::emu::get_last_error
#define cudaGetErrorString ::emu::error_string
#define cudaDeviceGetAttribute ::emu::device_attribute

// The source line of a sync point tells apart two barriers (CUDA forbids threads of a block to
// wait at different ones).
inline void __syncthreads(int line = __builtin_LINE()) { ::emu::sync_threads(line); }

template <class T>
inline T emu_shuffle(unsigned mask, T value, int src_lane, int line) {
  static_assert(sizeof(T) <= 8, "a shuffle moves at most 8 bytes");
  uint64_t bits = 0;
  std::memcpy(&bits, &value, sizeof(T));
  bits = ::emu::shuffle(mask, bits, src_lane, line);
  T out;
  std::memcpy(&out, &bits, sizeof(T));
  return out;
}
// A source lane past the caller's `width` segment gives the caller its own value (CUDA's rule).
template <class T>
inline T __shfl_xor_sync(unsigned mask, T value, int lane_mask, int width = 32, int line = __builtin_LINE()) {
  const int lane = ::emu::lane_id();
  const int src = lane ^ lane_mask;
  return emu_shuffle(mask, value, src < (lane / width + 1) * width ? src : lane, line);
}
template <class T>
inline T __shfl_sync(unsigned mask, T value, int src_lane, int width = 32, int line = __builtin_LINE()) {
  const int lane = ::emu::lane_id();
  return emu_shuffle(mask, value, lane / width * width + src_lane % width, line);
}
template <class T>
inline T __shfl_down_sync(unsigned mask, T value, unsigned delta, int width = 32, int line = __builtin_LINE()) {
  const int lane = ::emu::lane_id();
  const int src = lane + static_cast<int>(delta);
  return emu_shuffle(mask, value, src < (lane / width + 1) * width ? src : lane, line);
}

// Fibers are never pre-empted, so a plain read-modify-write is atomic. Under TSan it is a real
// atomic, so that a plain access racing with it is reported and atomics among themselves are not.
inline float atomicAdd(float* address, float value) {
#if defined(__SANITIZE_THREAD__)
  uint32_t old = __atomic_load_n(reinterpret_cast<uint32_t*>(address), __ATOMIC_RELAXED), next;
  float before;
  do {
    std::memcpy(&before, &old, 4);
    const float sum = before + value;
    std::memcpy(&next, &sum, 4);
  } while (!__atomic_compare_exchange_n(reinterpret_cast<uint32_t*>(address), &old, next, false, __ATOMIC_RELAXED,
                                        __ATOMIC_RELAXED));
  return before;
#else
  const float before = *address;
  *address = before + value;
  return before;
#endif
}

// The GPU's __expf is ex2.approx(x * log2(e)); exp2f is the correctly rounded version of that.
inline float __expf(float x) { return exp2f(x * 1.4426950408889634f); }

// Device min/max: the overloads of crt/math_functions.hpp, so calls resolve as they do under nvcc
// (std::min would reject min(int64_t, int) where CUDA converts).
#define EMU_MIN_MAX(R, A, B)                                                                             \
  inline R min(const A a, const B b) { return static_cast<R>(a) < static_cast<R>(b) ? static_cast<R>(a) : static_cast<R>(b); } \
  inline R max(const A a, const B b) { return static_cast<R>(a) > static_cast<R>(b) ? static_cast<R>(a) : static_cast<R>(b); }
EMU_MIN_MAX(int, int, int)
EMU_MIN_MAX(unsigned int, unsigned int, unsigned int)
EMU_MIN_MAX(unsigned int, int, unsigned int)
EMU_MIN_MAX(unsigned int, unsigned int, int)
EMU_MIN_MAX(long, long, long)
EMU_MIN_MAX(unsigned long, unsigned long, unsigned long)
EMU_MIN_MAX(unsigned long, long, unsigned long)
EMU_MIN_MAX(unsigned long, unsigned long, long)
EMU_MIN_MAX(long long, long long, long long)
EMU_MIN_MAX(unsigned long long, unsigned long long, unsigned long long)
EMU_MIN_MAX(unsigned long long, long long, unsigned long long)
EMU_MIN_MAX(unsigned long long, unsigned long long, long long)
#undef EMU_MIN_MAX
inline float min(const float a, const float b) { return fminf(a, b); }
inline float max(const float a, const float b) { return fmaxf(a, b); }
inline double min(const double a, const double b) { return fmin(a, b); }
inline double max(const double a, const double b) { return fmax(a, b); }
