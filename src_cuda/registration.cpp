// The one place where minipaged's op schemas are defined. Backends register kernels in their
// own TORCH_LIBRARY_IMPL blocks (cpu/kernels.cpp, cuda/bindings.cpp); Python adds fakes only.
#include <Python.h>
#include <torch/library.h>

#include <string>

TORCH_LIBRARY(minipaged, m) {
  // Writes key[i], value[i] into slot slot_mapping[i] of the caches; negative slots are skipped.
  m.def(
      "reshape_and_cache(Tensor key, Tensor value, Tensor(a!) key_cache, Tensor(b!) value_cache, "
      "Tensor slot_mapping) -> ()");
  // One-token decode attention, K/V read through block tables. max_seq_len, when given, is an
  // upper bound on seq_lens that lets the CUDA kernel size its grid without reading seq_lens.
  m.def(
      "paged_attention_decode(Tensor query, Tensor key_cache, Tensor value_cache, "
      "Tensor block_tables, Tensor seq_lens, float scale, int? max_seq_len=None) -> Tensor");
  // Causal attention for the new tokens of several sequences, packed [total_q, num_heads, head_dim]
  // (cu_seqlens_q: int32 [n + 1] offsets), over each sequence's paged history and themselves:
  // new token j of sequence i sits at position seq_lens[i] - q_i + j. max_query_len, when given,
  // bounds every q_i (the CUDA grid is sized from it instead of from total_q).
  m.def(
      "paged_attention_prefill(Tensor query, Tensor key_cache, Tensor value_cache, "
      "Tensor block_tables, Tensor cu_seqlens_q, Tensor seq_lens, float scale, "
      "int? max_query_len=None) -> Tensor");
  // Copies whole blocks (src, dst) in both caches: the data side of copy-on-write.
  m.def("copy_blocks(Tensor(a!) key_cache, Tensor(b!) value_cache, Tensor block_mapping) -> ()");
  // What this build compiled, and why a backend is missing (e.g. no nvcc for a CUDA torch).
  m.def("build_info() -> str", [] { return std::string(MINIPAGED_BUILD_INFO); });
}

// _C is imported as a Python extension module so that the library loads once per process
// (a second import is a no-op) and is found the same way in editable and regular installs.
extern "C" PyMODINIT_FUNC PyInit__C(void) {
  static PyModuleDef module = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  return PyModule_Create(&module);
}
