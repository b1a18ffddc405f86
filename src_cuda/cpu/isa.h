// CPU kernels built once per instruction set, one of them chosen when _C loads (dispatch.cpp).
//
// To put a kernel file under this dispatch:
//   1. CMakeLists.txt: list it in MINIPAGED_CPU_ISA_SOURCES (it is then compiled once per
//      variant, with that variant's -m flags and MINIPAGED_CPU_ISA set to its name);
//   2. in the file: put everything in `namespace minipaged::MINIPAGED_CPU_ISA { ... }` (so the
//      copies do not collide) and register with `MINIPAGED_CPU_IMPL(m) { m.impl(...); }` in place
//      of `TORCH_LIBRARY_IMPL(minipaged, CPU, m)`, once per file.
// Inside, `#if defined(__AVX512BF16__)` and the like select code as usual: each copy sees its
// own variant's macros.
#pragma once
#include "cpu/dispatch.h"

#ifndef MINIPAGED_CPU_ISA
#error "compiled outside the per-instruction-set build: list this file in MINIPAGED_CPU_ISA_SOURCES"
#endif

#define MINIPAGED_CPU_ISA_STR_(x) #x
#define MINIPAGED_CPU_ISA_STR(x) MINIPAGED_CPU_ISA_STR_(x)
#define MINIPAGED_CPU_IMPL(m)                                                                     \
  static void minipaged_cpu_impl(torch::Library&);                                                \
  [[maybe_unused]] static const bool minipaged_cpu_impl_added =                                   \
      ::minipaged::cpu_dispatch::add_kernels(MINIPAGED_CPU_ISA_STR(MINIPAGED_CPU_ISA), &minipaged_cpu_impl); \
  static void minipaged_cpu_impl(torch::Library& m)
