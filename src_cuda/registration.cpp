// The one place where minipaged's op schemas are defined. Backends register kernels in their
// own TORCH_LIBRARY_IMPL blocks (cpu/kernels.cpp, cuda/bindings.cpp); Python adds fakes only.
#include <Python.h>
#include <torch/library.h>

#include <string>

#include "cpu/dispatch.h"

TORCH_LIBRARY(minipaged, m) {
  // Writes key[i], value[i] into slot slot_mapping[i] of the caches; negative slots are skipped.
  // 8-bit caches (quant.h; the format follows the cache dtype) quantize here and take scales:
  // int8 writes the tokens' scales into key_scale / value_scale ([num_blocks, num_kv_heads,
  // block_size] float32), fp8 reads its layer's (one float32 each). Float caches take none.
  m.def(
      "reshape_and_cache(Tensor key, Tensor value, Tensor(a!) key_cache, Tensor(b!) value_cache, "
      "Tensor slot_mapping, Tensor(c!)? key_scale=None, Tensor(d!)? value_scale=None) -> ()");
  // One-token decode attention, K/V read through block tables. max_seq_len, when given, is an
  // upper bound on seq_lens that lets the CUDA kernel size its grid without reading seq_lens.
  // key_scale / value_scale: an 8-bit cache's, as reshape_and_cache takes them.
  m.def(
      "paged_attention_decode(Tensor query, Tensor key_cache, Tensor value_cache, "
      "Tensor block_tables, Tensor seq_lens, float scale, int? max_seq_len=None, Tensor? key_scale=None, "
      "Tensor? value_scale=None) -> Tensor");
  // Causal attention for the new tokens of several sequences, packed [total_q, num_heads, head_dim]
  // (cu_seqlens_q: int32 [n + 1] offsets), over each sequence's paged history and themselves:
  // new token j of sequence i sits at position seq_lens[i] - q_i + j. max_query_len, when given,
  // bounds every q_i (the CUDA grid is sized from it instead of from total_q).
  m.def(
      "paged_attention_prefill(Tensor query, Tensor key_cache, Tensor value_cache, "
      "Tensor block_tables, Tensor cu_seqlens_q, Tensor seq_lens, float scale, "
      "int? max_query_len=None, Tensor? key_scale=None, Tensor? value_scale=None) -> Tensor");
  // Copies whole blocks (src, dst) in both caches: the data side of copy-on-write. An int8 cache's
  // scales are paged like it and are copied with it; an fp8 cache's (per layer) are left alone.
  m.def(
      "copy_blocks(Tensor(a!) key_cache, Tensor(b!) value_cache, Tensor block_mapping, "
      "Tensor(c!)? key_scale=None, Tensor(d!)? value_scale=None) -> ()");
  // input @ weight.T + bias with a float32/bfloat16/float16 weight, or int8 (weight_scale per
  // output row) or int4 (uint8, two a byte; weight_scale and weight_zero per group), in float32
  // arithmetic (cpu/linear.cpp): for CPUs without 16-bit dot products, few-row steps that should
  // read the weight once, and weight-only quantization. Returns input's dtype. CPU only.
  m.def("linear_widened(Tensor input, Tensor weight, Tensor? bias=None, Tensor? weight_scale=None, Tensor? weight_zero=None) -> Tensor");
  // logits[r, t] = -inf for each row r in indices and token t whose bit is clear in bitmask[r]
  // (int32 [rows, ceil(vocab / 32)], token t at bit t % 32 of word t // 32; tokens past the
  // bitmask are masked too): a grammar's allowed tokens (cpu/token_bitmask.cpp). CPU only.
  m.def("apply_token_bitmask_(Tensor(a!) logits, Tensor bitmask, Tensor indices) -> ()");
  // What this build compiled, and why a backend is missing (e.g. no nvcc for a CUDA torch).
  m.def("build_info() -> str", [] { return std::string(MINIPAGED_BUILD_INFO); });
  // The CPU kernels' instruction-set variant in use, and those this CPU could use (cpu/isa.h).
  m.def("cpu_isa() -> str", [] { return minipaged::cpu_dispatch::cpu_isa(); });
  m.def("supported_cpu_isas() -> str[]", [] { return minipaged::cpu_dispatch::supported_isas(); });
}

// _C is imported as a Python extension module so that the library loads once per process
// (a second import is a no-op) and is found the same way in editable and regular installs.
// The CPU kernels register here rather than at static init, once every per-instruction-set
// variant has added itself, so that one of them is chosen (a bad MINIPAGED_CPU_ISA fails the import).
extern "C" PyMODINIT_FUNC PyInit__C(void) {
  try {
    minipaged::cpu_dispatch::register_cpu_kernels();
  } catch (const std::exception& err) {
    PyErr_SetString(PyExc_RuntimeError, err.what());
    return nullptr;
  }
  static PyModuleDef module = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  return PyModule_Create(&module);
}
