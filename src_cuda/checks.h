// Input validation shared by the CPU and CUDA bindings.
//
// Two kinds of check: shape/dtype/device checks on tensor metadata (always, cheap, no data
// read) and range checks on index data (block ids, slots, sequence lengths). The CPU backend
// always runs the range checks; the CUDA backend runs them only when MINIPAGED_VALIDATE=1,
// because reading device data on the host is a sync. Every check runs before anything is
// written, so rejected input leaves the cache untouched.
#pragma once
#include <ATen/core/Tensor.h>

#include <optional>

#include "cache_layout.h"
#include "quant.h"

namespace minipaged {

CacheLayout check_cache_pair(const at::Tensor& key_cache, const at::Tensor& value_cache);

// The 8-bit format of a cache (quant.h) from its dtype: int8, float8_e4m3fn, float8_e5m2; kNone for
// float32, float16 and bfloat16.
KVFormat kv_format_of(const at::Tensor& cache);
// key_scale / value_scale against the caches' format: none for a float cache; for int8, float32
// [num_blocks, num_kv_heads, block_size] contiguous; for fp8, float32 with one element (the
// layer's scale). `writes`: the op writes the int8 scales (reshape_and_cache, copy_blocks).
KVFormat check_kv_scales(const at::Tensor& key_cache, const CacheLayout& layout,
                         const std::optional<at::Tensor>& key_scale,
                         const std::optional<at::Tensor>& value_scale);
// An fp8 layer scale must be finite and > 0 (reads the scale: the CPU always, CUDA when
// validate_device_data()). Returns the (key, value) scales, 1 for other formats.
struct LayerScales {
  float key = 1.f, value = 1.f;
};
LayerScales check_layer_scale_values(KVFormat format, const std::optional<at::Tensor>& key_scale,
                                     const std::optional<at::Tensor>& value_scale);

CacheLayout check_reshape_and_cache(const at::Tensor& key, const at::Tensor& value,
                                    const at::Tensor& key_cache, const at::Tensor& value_cache,
                                    const at::Tensor& slot_mapping);
void check_slot_range(const at::Tensor& slot_mapping, const CacheLayout& layout);

CacheLayout check_paged_attention_decode(const at::Tensor& query, const at::Tensor& key_cache,
                                         const at::Tensor& value_cache,
                                         const at::Tensor& block_tables, const at::Tensor& seq_lens);
void check_decode_ranges(const at::Tensor& block_tables, const at::Tensor& seq_lens,
                         const CacheLayout& layout);
// max_seq_len, when given, must bound every seq_len (the CUDA kernel clamps to it unchecked).
void check_max_seq_len(const at::Tensor& seq_lens, std::optional<int64_t> max_seq_len);

// The decode op's checks, for packed queries [total_q, num_heads, head_dim] whose sequence i
// owns rows cu_seqlens_q[i] .. cu_seqlens_q[i + 1].
CacheLayout check_paged_attention_prefill(const at::Tensor& query, const at::Tensor& key_cache,
                                          const at::Tensor& value_cache, const at::Tensor& block_tables,
                                          const at::Tensor& cu_seqlens_q, const at::Tensor& seq_lens);
// check_decode_ranges, plus: cu_seqlens_q starts at 0, never decreases and ends at total_q, and
// no sequence has more new tokens than tokens. Returns the longest q_i.
int64_t check_prefill_ranges(const at::Tensor& block_tables, const at::Tensor& cu_seqlens_q,
                             const at::Tensor& seq_lens, int64_t total_q, const CacheLayout& layout);

CacheLayout check_copy_blocks(const at::Tensor& key_cache, const at::Tensor& value_cache,
                              const at::Tensor& block_mapping);
void check_copy_ranges(const at::Tensor& block_mapping, const CacheLayout& layout);

// The integers of a 1-D or 2-D int32 / int64 index tensor, read on the host: a CPU tensor in
// place through its strides, a device tensor copied once. In place because every op call reads
// its indices: converting them (.to(int64).contiguous()) is a dispatcher call, an allocation and a
// copy, and with cold caches that cost ~50 us per op call (bench/RESULTS.md).
class HostInts {
 public:
  explicit HostInts(const at::Tensor& t);
  int64_t operator()(int64_t i) const { return element(i * stride0_); }
  int64_t operator()(int64_t i, int64_t j) const { return element(i * stride0_ + j * stride1_); }

 private:
  int64_t element(int64_t k) const {
    return wide_ ? static_cast<const int64_t*>(data_)[k] : static_cast<const int32_t*>(data_)[k];
  }
  at::Tensor host_;  // the tensor itself, or its copy on the host
  const void* data_;
  bool wide_;
  int64_t stride0_, stride1_;
};

// MINIPAGED_VALIDATE=1 turns on the (syncing) range checks for device tensors.
bool validate_device_data();

}  // namespace minipaged
