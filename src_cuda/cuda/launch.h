// The plain C++ interface between the torch-facing bindings (bindings.cpp, compiled by the host
// compiler) and the CUDA kernels (kernels.cu). Keeping torch headers out of kernels.cu makes it
// compile in seconds instead of minutes.
#pragma once
#include <cuda_runtime_api.h>

#include <cstdint>

#include "cache_layout.h"
#include "quant.h"

namespace minipaged::cuda {

enum class DType { kFloat, kHalf, kBFloat16 };

struct DecodeArgs {
  void* out;                 // [num_seqs, num_heads, head_dim], contiguous, query dtype
  const void* query;         // [num_seqs, num_heads, head_dim], last dim contiguous
  int64_t query_seq_stride, query_head_stride;
  const void* key_cache;     // CacheLayout, contiguous
  const void* value_cache;
  const int32_t* block_tables;  // [num_seqs, max_blocks_per_seq], contiguous
  const int32_t* seq_lens;      // [num_seqs]
  CacheLayout layout;
  int64_t max_blocks_per_seq;
  int64_t seq_len_bound;     // seq_lens are clamped to this: max_seq_len, or what block_tables address
  int num_seqs, num_heads;
  float scale;
  int num_partitions;        // 1: single pass writes `out`; >1: split-K through the buffers below
  int partition_tokens;
  float* partial_out;        // [num_seqs, num_heads, num_partitions, head_dim]
  float* partial_max;        // [num_seqs, num_heads, num_partitions]
  float* partial_sum;        // [num_seqs, num_heads, num_partitions]
  // An 8-bit cache (quant.h; then query and out are float): int8's per-token scales
  // [num_blocks, num_kv_heads, block_size], or fp8's layer scales (one float each, on the device).
  KVFormat format;
  const float* key_scale;
  const float* value_scale;
};

bool decode_supports_head_dim(int64_t head_dim);
// Tokens per split-K partition: sized so that the grid fills `num_sms` several times over.
int decode_partition_tokens(int64_t num_seqs, int64_t num_kv_heads, int64_t group,
                            int64_t max_seq_len, int num_sms);

cudaError_t launch_paged_attention_decode(const DecodeArgs& args, DType dtype, cudaStream_t stream);

cudaError_t launch_reshape_and_cache(const void* key, const void* value, int64_t key_token_stride,
                                     int64_t key_head_stride, int64_t key_dim_stride,
                                     int64_t value_token_stride, int64_t value_head_stride,
                                     int64_t value_dim_stride, void* key_cache, void* value_cache,
                                     const void* slot_mapping, bool slots_int64, int64_t num_tokens,
                                     CacheLayout layout, DType dtype, cudaStream_t stream);

// reshape_and_cache into an 8-bit cache: key/value ([num_tokens, num_kv_heads, head_dim], any
// strides) quantized into their slots; int8 writes each row's scale, fp8 reads the layer's.
struct QuantizeArgs {
  const void* key;
  const void* value;
  int64_t key_strides[3], value_strides[3];
  void* key_cache;
  void* value_cache;
  float* key_scale;             // int8: written, [num_blocks, num_kv_heads, block_size]; fp8: read, 1 float
  float* value_scale;
  const int64_t* slot_mapping;  // [num_tokens], negative or out of range: skipped
  int64_t num_tokens;
  CacheLayout layout;
  KVFormat format;
};
cudaError_t launch_quantize_and_cache(const QuantizeArgs& args, DType input_dtype, cudaStream_t stream);

cudaError_t launch_copy_blocks(void* key_cache, void* value_cache, const int64_t* block_mapping,
                               int64_t num_pairs, int64_t block_bytes, int64_t num_blocks,
                               cudaStream_t stream);

}  // namespace minipaged::cuda

// ---- paged_attention_prefill (cuda/prefill.cu)
namespace minipaged::cuda {

struct PrefillArgs {
  void* out;                    // [total_q, num_heads, head_dim], contiguous, query dtype
  const void* query;            // [total_q, num_heads, head_dim], last dim contiguous
  int64_t query_token_stride, query_head_stride;
  const void* key_cache;        // CacheLayout, contiguous
  const void* value_cache;
  const int32_t* block_tables;  // [num_seqs, max_blocks_per_seq], contiguous
  const int32_t* cu_seqlens_q;  // [num_seqs + 1]
  const int32_t* seq_lens;      // [num_seqs]
  CacheLayout layout;
  int64_t max_blocks_per_seq, total_q;
  int num_seqs, num_heads;
  float scale;
  int query_tiles;              // tiles of (token, head) rows per sequence and kv head (grid.y strides)
  int num_splits;               // 1: one pass writes `out`; >1: the history is split, merged after
  int split_tokens;
  float* partial_out;           // [total_q, num_heads, num_splits, head_dim]
  float* partial_max;           // [total_q, num_heads, num_splits]
  float* partial_sum;           // [total_q, num_heads, num_splits], zeroed by the caller
  KVFormat format;              // as in DecodeArgs
  const float* key_scale;
  const float* value_scale;
};

struct PrefillPlan {
  int query_tiles, num_splits, split_tokens;
};
// Grid shape from bounds only (no device data is read): max_query_len bounds every q_i and
// max_keys every seq_len; the history is split when too few thread blocks would fill the GPU.
PrefillPlan prefill_plan(int64_t max_query_len, int64_t group, int64_t num_seqs, int64_t num_kv_heads,
                         int64_t max_keys, int num_sms);

cudaError_t launch_paged_attention_prefill(const PrefillArgs& args, DType dtype, cudaStream_t stream);

}  // namespace minipaged::cuda
