// CUDA bindings: validate, then launch on the current stream under a device guard. Nothing here
// reads device data (no host sync, so the ops are CUDA-graph safe) unless MINIPAGED_VALIDATE=1.
#include <ATen/ATen.h>
#include <torch/library.h>

#if defined(MINIPAGED_EMULATION)
#include "emulation/torch_cuda.h"  // the same bindings over the emulated kernels (src_cuda/emulation/)
#else
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#define MINIPAGED_CUDA_LIBRARY_IMPL(m) TORCH_LIBRARY_IMPL(minipaged, CUDA, m)
#endif

#include "checks.h"
#include "cuda/launch.h"

namespace minipaged {
namespace {

cuda::DType dtype_of(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat: return cuda::DType::kFloat;
    case at::kHalf: return cuda::DType::kHalf;
    default: return cuda::DType::kBFloat16;  // callers pass only float32, float16 or bfloat16 tensors
  }
}

void check_launch(cudaError_t err, const char* op) {
  TORCH_CHECK(err == cudaSuccess, op, ": CUDA launch failed: ", cudaGetErrorString(err));
}

// An 8-bit cache's checks beyond the metadata: its fp8 layer scales finite and > 0, read from the
// device only under MINIPAGED_VALIDATE=1 (a sync). Returns the format.
KVFormat check_quantized(const at::Tensor& key_cache, const CacheLayout& layout,
                         const std::optional<at::Tensor>& key_scale, const std::optional<at::Tensor>& value_scale) {
  const KVFormat format = check_kv_scales(key_cache, layout, key_scale, value_scale);
  if (validate_device_data()) check_layer_scale_values(format, key_scale, value_scale);
  return format;
}

const float* scale_ptr(const std::optional<at::Tensor>& scale) {
  return scale.has_value() ? scale->data_ptr<float>() : nullptr;
}

int sm_count(int device) {
  static int cached[64] = {};
  device = std::max(device, 0);  // -1: the emulation's CPU tensors
  if (device < 64 && cached[device] == 0) {
    cudaDeviceGetAttribute(&cached[device], cudaDevAttrMultiProcessorCount, device);
  }
  return device < 64 ? cached[device] : 132;
}

at::Tensor paged_attention_decode_cuda(const at::Tensor& query, const at::Tensor& key_cache,
                                       const at::Tensor& value_cache, const at::Tensor& block_tables,
                                       const at::Tensor& seq_lens, double scale,
                                       std::optional<int64_t> max_seq_len, const std::optional<at::Tensor>& key_scale,
                                       const std::optional<at::Tensor>& value_scale) {
  const CacheLayout layout = check_paged_attention_decode(query, key_cache, value_cache, block_tables, seq_lens);
  const KVFormat format = check_quantized(key_cache, layout, key_scale, value_scale);
  TORCH_CHECK_VALUE(cuda::decode_supports_head_dim(layout.head_dim),
                    "key_cache: head_dim ", layout.head_dim, " is not supported by the CUDA decode kernel "
                    "(supported: 64, 128, 256)");
  TORCH_CHECK_VALUE(query.stride(2) == 1, "query: expected the last dimension to be contiguous, got strides ",
                    query.strides());
  TORCH_CHECK_VALUE(reinterpret_cast<uintptr_t>(key_cache.data_ptr()) % 16 == 0 &&
                        reinterpret_cast<uintptr_t>(value_cache.data_ptr()) % 16 == 0,
                    "key_cache/value_cache: expected 16-byte aligned storage (a view with an odd storage offset?)");
  if (max_seq_len.has_value())
    TORCH_CHECK_VALUE(*max_seq_len >= 0, "max_seq_len: expected a non-negative bound, got ", *max_seq_len);
  if (validate_device_data()) {
    check_decode_ranges(block_tables, seq_lens, layout);
    check_max_seq_len(seq_lens, max_seq_len);
  }

  const c10::cuda::CUDAGuard guard(query.device());
  const int64_t num_seqs = query.size(0), num_heads = query.size(1), width = block_tables.size(1);
  // An 8-bit cache's kernels take a float query and give a float output (converted back below).
  const at::Tensor q = format == KVFormat::kNone ? query : query.to(at::kFloat);
  at::Tensor out = at::empty({num_seqs, num_heads, layout.head_dim}, q.options());
  if (num_seqs == 0) return out.to(query.scalar_type());

  // The grid is sized from shapes only (seq_lens stays on the device): the longest sequence is
  // bounded by what the block table addresses, or by the caller's max_seq_len hint.
  const int64_t bound = std::min(width * layout.block_size, max_seq_len.value_or(width * layout.block_size));
  const int64_t group = num_heads / layout.num_kv_heads;
  const int partition = cuda::decode_partition_tokens(num_seqs, layout.num_kv_heads, group, bound,
                                                      sm_count(query.get_device()));
  const int num_partitions = static_cast<int>(std::max<int64_t>(1, (bound + partition - 1) / partition));
  at::Tensor tables = block_tables.contiguous(), lens = seq_lens.contiguous();

  cuda::DecodeArgs args{};
  args.out = out.data_ptr();
  args.query = q.data_ptr();
  args.query_seq_stride = q.stride(0);
  args.query_head_stride = q.stride(1);
  args.key_cache = key_cache.data_ptr();
  args.value_cache = value_cache.data_ptr();
  args.block_tables = tables.data_ptr<int32_t>();
  args.seq_lens = lens.data_ptr<int32_t>();
  args.format = format;
  args.key_scale = scale_ptr(key_scale);
  args.value_scale = scale_ptr(value_scale);
  args.layout = layout;
  args.max_blocks_per_seq = width;
  args.seq_len_bound = bound;
  args.num_seqs = static_cast<int>(num_seqs);
  args.num_heads = static_cast<int>(num_heads);
  args.scale = static_cast<float>(scale);
  args.num_partitions = num_partitions;
  args.partition_tokens = partition;
  at::Tensor partial_out, partial_stats;
  if (num_partitions > 1) {
    const auto f32 = query.options().dtype(at::kFloat);
    partial_out = at::empty({num_seqs, num_heads, num_partitions, layout.head_dim}, f32);
    partial_stats = at::empty({2, num_seqs, num_heads, num_partitions}, f32);
    args.partial_out = partial_out.data_ptr<float>();
    args.partial_max = partial_stats[0].data_ptr<float>();
    args.partial_sum = partial_stats[1].data_ptr<float>();
  }
  check_launch(cuda::launch_paged_attention_decode(args, dtype_of(q), c10::cuda::getCurrentCUDAStream()),
               "paged_attention_decode");
  return out.to(query.scalar_type());
}

void reshape_and_cache_cuda(const at::Tensor& key, const at::Tensor& value, at::Tensor& key_cache,
                            at::Tensor& value_cache, const at::Tensor& slot_mapping,
                            const std::optional<at::Tensor>& key_scale, const std::optional<at::Tensor>& value_scale) {
  const CacheLayout layout = check_reshape_and_cache(key, value, key_cache, value_cache, slot_mapping);
  const KVFormat format = check_quantized(key_cache, layout, key_scale, value_scale);
  if (validate_device_data()) check_slot_range(slot_mapping, layout);
  const c10::cuda::CUDAGuard guard(key.device());
  if (format != KVFormat::kNone) {
    const at::Tensor slots = slot_mapping.to(at::kLong).contiguous();
    cuda::QuantizeArgs args{};
    args.key = key.data_ptr();
    args.value = value.data_ptr();
    for (int i = 0; i < 3; ++i) args.key_strides[i] = key.stride(i), args.value_strides[i] = value.stride(i);
    args.key_cache = key_cache.data_ptr();
    args.value_cache = value_cache.data_ptr();
    args.key_scale = key_scale->data_ptr<float>();
    args.value_scale = value_scale->data_ptr<float>();
    args.slot_mapping = slots.data_ptr<int64_t>();
    args.num_tokens = key.size(0);
    args.layout = layout;
    args.format = format;
    check_launch(cuda::launch_quantize_and_cache(args, dtype_of(key), c10::cuda::getCurrentCUDAStream()),
                 "reshape_and_cache");
    return;
  }
  const at::Tensor slots = slot_mapping.contiguous();
  check_launch(cuda::launch_reshape_and_cache(
                   key.data_ptr(), value.data_ptr(), key.stride(0), key.stride(1), key.stride(2), value.stride(0),
                   value.stride(1), value.stride(2), key_cache.data_ptr(), value_cache.data_ptr(), slots.data_ptr(),
                   slots.scalar_type() == at::kLong, key.size(0), layout, dtype_of(key_cache),
                   c10::cuda::getCurrentCUDAStream()),
               "reshape_and_cache");
}

void copy_blocks_cuda(at::Tensor& key_cache, at::Tensor& value_cache, const at::Tensor& block_mapping,
                      const std::optional<at::Tensor>& key_scale, const std::optional<at::Tensor>& value_scale) {
  const CacheLayout layout = check_copy_blocks(key_cache, value_cache, block_mapping);
  const KVFormat format = check_kv_scales(key_cache, layout, key_scale, value_scale);
  if (validate_device_data()) check_copy_ranges(block_mapping, layout);
  const c10::cuda::CUDAGuard guard(key_cache.device());
  const at::Tensor pairs = block_mapping.contiguous();
  check_launch(cuda::launch_copy_blocks(key_cache.data_ptr(), value_cache.data_ptr(), pairs.data_ptr<int64_t>(),
                                        pairs.size(0), layout.block_elems() * key_cache.element_size(),
                                        layout.num_blocks, c10::cuda::getCurrentCUDAStream()),
               "copy_blocks");
  if (format == KVFormat::kInt8)  // the blocks' scales travel with them (an fp8 layer's stay)
    check_launch(cuda::launch_copy_blocks(key_scale->data_ptr(), value_scale->data_ptr(), pairs.data_ptr<int64_t>(),
                                          pairs.size(0), layout.num_kv_heads * layout.block_size * sizeof(float),
                                          layout.num_blocks, c10::cuda::getCurrentCUDAStream()),
                 "copy_blocks");
}

// ---- paged_attention_prefill (kernel in cuda/prefill.cu)

at::Tensor paged_attention_prefill_cuda(const at::Tensor& query, const at::Tensor& key_cache,
                                        const at::Tensor& value_cache, const at::Tensor& block_tables,
                                        const at::Tensor& cu_seqlens_q, const at::Tensor& seq_lens, double scale,
                                        std::optional<int64_t> max_query_len,
                                        const std::optional<at::Tensor>& key_scale,
                                        const std::optional<at::Tensor>& value_scale) {
  const CacheLayout layout =
      check_paged_attention_prefill(query, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens);
  const KVFormat format = check_quantized(key_cache, layout, key_scale, value_scale);
  TORCH_CHECK_VALUE(cuda::decode_supports_head_dim(layout.head_dim), "key_cache: head_dim ", layout.head_dim,
                    " is not supported by the CUDA prefill kernel (supported: 64, 128, 256)");
  TORCH_CHECK_VALUE(query.stride(2) == 1, "query: expected the last dimension to be contiguous, got strides ",
                    query.strides());
  TORCH_CHECK_VALUE(reinterpret_cast<uintptr_t>(key_cache.data_ptr()) % 16 == 0 &&
                        reinterpret_cast<uintptr_t>(value_cache.data_ptr()) % 16 == 0,
                    "key_cache/value_cache: expected 16-byte aligned storage (a view with an odd storage offset?)");
  if (max_query_len.has_value())
    TORCH_CHECK_VALUE(*max_query_len >= 0, "max_query_len: expected a non-negative bound, got ", *max_query_len);
  const int64_t num_seqs = seq_lens.size(0), total_q = query.size(0), width = block_tables.size(1);
  if (validate_device_data()) {
    const int64_t longest = check_prefill_ranges(block_tables, cu_seqlens_q, seq_lens, total_q, layout);
    if (max_query_len.has_value())
      TORCH_CHECK_VALUE(longest <= *max_query_len, "max_query_len: ", *max_query_len,
                        " is smaller than the most new tokens of a sequence in cu_seqlens_q (", longest, ")");
  }

  const c10::cuda::CUDAGuard guard(query.device());
  // An 8-bit cache's kernels take a float query and give a float output (converted back below).
  const at::Tensor q = format == KVFormat::kNone ? query : query.to(at::kFloat);
  at::Tensor out = at::empty({total_q, query.size(1), layout.head_dim}, q.options());
  if (total_q == 0 || num_seqs == 0) return out.to(query.scalar_type());
  const int64_t group = query.size(1) / layout.num_kv_heads;
  const int64_t q_bound = std::min(total_q, max_query_len.value_or(total_q));
  const cuda::PrefillPlan plan = cuda::prefill_plan(q_bound, group, num_seqs, layout.num_kv_heads,
                                                    width * layout.block_size, sm_count(query.get_device()));
  TORCH_CHECK_VALUE(layout.num_kv_heads * plan.num_splits <= 65535, "key_cache: num_kv_heads x history splits (",
                    layout.num_kv_heads, " x ", plan.num_splits, ") exceeds the CUDA grid's 65535");
  at::Tensor tables = block_tables.contiguous(), lens = seq_lens.contiguous(), cu = cu_seqlens_q.contiguous();

  cuda::PrefillArgs args{};
  args.out = out.data_ptr();
  args.query = q.data_ptr();
  args.query_token_stride = q.stride(0);
  args.query_head_stride = q.stride(1);
  args.format = format;
  args.key_scale = scale_ptr(key_scale);
  args.value_scale = scale_ptr(value_scale);
  args.key_cache = key_cache.data_ptr();
  args.value_cache = value_cache.data_ptr();
  args.block_tables = tables.data_ptr<int32_t>();
  args.cu_seqlens_q = cu.data_ptr<int32_t>();
  args.seq_lens = lens.data_ptr<int32_t>();
  args.layout = layout;
  args.max_blocks_per_seq = width;
  args.total_q = total_q;
  args.num_seqs = static_cast<int>(num_seqs);
  args.num_heads = static_cast<int>(query.size(1));
  args.scale = static_cast<float>(scale);
  args.query_tiles = plan.query_tiles;
  args.num_splits = plan.num_splits;
  args.split_tokens = plan.split_tokens;
  at::Tensor partial_out, partial_stats;
  if (plan.num_splits > 1) {
    const auto f32 = query.options().dtype(at::kFloat);
    partial_out = at::empty({total_q, query.size(1), plan.num_splits, layout.head_dim}, f32);
    partial_stats = at::zeros({2, total_q, query.size(1), plan.num_splits}, f32);
    args.partial_out = partial_out.data_ptr<float>();
    args.partial_max = partial_stats[0].data_ptr<float>();
    args.partial_sum = partial_stats[1].data_ptr<float>();
  }
  check_launch(cuda::launch_paged_attention_prefill(args, dtype_of(q), c10::cuda::getCurrentCUDAStream()),
               "paged_attention_prefill");
  return out.to(query.scalar_type());
}

}  // namespace

MINIPAGED_CUDA_LIBRARY_IMPL(m) {
  m.impl("reshape_and_cache", &reshape_and_cache_cuda);
  m.impl("paged_attention_decode", &paged_attention_decode_cuda);
  m.impl("copy_blocks", &copy_blocks_cuda);
  m.impl("paged_attention_prefill", &paged_attention_prefill_cuda);
}

}  // namespace minipaged
