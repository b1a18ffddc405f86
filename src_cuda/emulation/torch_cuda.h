// What cuda/bindings.cpp takes from c10/cuda, for the emulation build: the bindings compile
// unchanged over the emulated kernels and register them as CPU kernels of torch.ops.minipaged_emu.
// The tensors are CPU tensors, so there is no device to guard and no stream to launch on.
#pragma once
#include <c10/core/Device.h>

#include "emulation/cuda_emu.h"

namespace c10::cuda {

struct CUDAGuard {
  explicit CUDAGuard(c10::Device) {}
};

struct CUDAStream {
  operator cudaStream_t() const { return nullptr; }
};
inline CUDAStream getCurrentCUDAStream() { return {}; }

}  // namespace c10::cuda

#define MINIPAGED_CUDA_LIBRARY_IMPL(m) TORCH_LIBRARY_IMPL(minipaged_emu, CPU, m)
