// CPU prefill attention: causal attention for packed new tokens over their sequences' paged
// history. Unlike decode, this is compute-bound (every K/V row meets many query rows), so the
// plan is to reuse each K/V row from L1 as often as possible: a work item is a tile of query
// rows — up to kTileRows (new token, query head) pairs of one GQA group — and streams its
// sequence's blocks of one kv head past the tile with an online softmax. Work items are
// (sequence, query tile, kv head), handed out from one shared counter in one parallel region.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

#include "cache_layout.h"
#include "checks.h"
#include "cpu/head_tile.h"
#include "cpu/isa.h"
#include "cpu/prefill_tile.h"
#include "cpu/row_prefetch.h"
#include "cpu/vec.h"

namespace minipaged::MINIPAGED_CPU_ISA {
namespace {

// Q: the query's (and output's) type; T: the cache's (Q, or an 8-bit format with Q float: an
// 8-bit cache's query is converted to float beforehand, so its kernels are compiled once). On the
// generic path an fp8 layer's K scale is folded into the query and its V scale into the output;
// int8's per-token scales multiply each block's scores and probabilities.
template <typename Q, typename T>
void prefill_work_item(const PrefillItem& item, const Q* query, int64_t q_token_stride, int64_t q_head_stride,
                       int64_t q_begin, int64_t context, float scale, const T* key_cache, const T* value_cache,
                       const CacheLayout& layout, const int32_t* block_table, int64_t group, Q* out,
                       int64_t num_heads, TileScratch& w, const KVScales& kv_scales) {
#if defined(MINIPAGED_LANES)
  if (prefill_lanes(item, query, q_token_stride, q_head_stride, q_begin, context, scale, key_cache, value_cache,
                    layout, block_table, group, out, num_heads, w, kv_scales))
    return;
#endif
  constexpr bool kPerTokenScales = std::is_same_v<T, int8_t>;
  const int64_t D = layout.head_dim, B = layout.block_size;
  const int64_t rows = item.num_tokens * group, h0 = item.kv_head * group;
#if defined(__AVX512BF16__)
  const bool bf16_dot = std::is_same_v<T, c10::BFloat16> && D % 32 == 0 && B <= 256;
#else
  const bool bf16_dot = false;
#endif
  w.q.resize(rows * D);
  w.scores.resize(rows * B);
  w.max_score.assign(rows, -std::numeric_limits<float>::infinity());
  w.exp_sum.assign(rows, f32x16{});
  w.acc.assign(rows * D, 0.f);
  if (bf16_dot) w.q_bf16.resize(rows * D);
  for (int64_t r = 0; r < rows; ++r) {
    const Q* src = query + (q_begin + item.first_token + r / group) * q_token_stride + (h0 + r % group) * q_head_stride;
    for (int64_t d = 0; d < D; ++d) w.q[r * D + d] = static_cast<float>(src[d]) * (scale * kv_scales.key_layer);
    if (bf16_dot) std::memcpy(w.q_bf16.data() + r * D, src, D * sizeof(T));  // same type: T is bfloat16
  }
  float* scores = w.scores.data();
  float* acc = w.acc.data();
  // Query row r (token t = r / group) sits at position context + first_token + t and sees keys
  // 0 .. that position; the tile as a whole sees keys [0, end).
  const int64_t first_pos = context + item.first_token;
  const int64_t end = first_pos + item.num_tokens;
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  for (int64_t pos = 0; pos < end; pos += B) {
    const int64_t n = std::min(B, end - pos);
    const int64_t row = layout.row(block_table[pos / B], item.kv_head, 0);
    const T* k = key_cache + row;
    const T* v = value_cache + row;
    // Tokens before `pos` see none of this block: they are a prefix of the tile (rows are
    // sorted by position), so the block is computed for the rows from `live` on.
    const int64_t live = std::max<int64_t>(0, pos - first_pos) * group;
    RowPrefetch next_k, next_v;
    if (pos + B < end) {
      const int64_t next = layout.row(block_table[(pos + B) / B], item.kv_head, 0);
      const int64_t row_bytes = D * static_cast<int64_t>(sizeof(T));
      next_k = RowPrefetch::rows_at(reinterpret_cast<const char*>(key_cache + next), row_bytes, B);
      next_v = RowPrefetch::rows_at(reinterpret_cast<const char*>(value_cache + next), row_bytes, B);
    }
    for (int64_t r0 = live; r0 < rows; r0 += kMaxTile) {
      const int64_t gt = std::min(kMaxTile, rows - r0);
      with_tile(gt, [&](auto tile) {
#if defined(__AVX512BF16__)
        if constexpr (std::is_same_v<T, c10::BFloat16>)
          if (bf16_dot) return tile.scores_bf16(w.q_bf16.data() + r0 * D, scale, k, n, D, scores + r0 * B, B, next_k);
#endif
        tile.scores(w.q.data() + r0 * D, k, n, D, scores + r0 * B, B, next_k);
      });
      for (int64_t r = r0; r < r0 + gt; ++r) {
        if constexpr (kPerTokenScales)
          for (int64_t t = 0; t < n; ++t) scores[r * B + t] *= kv_scales.key[row / D + t];
        const int64_t visible = first_pos + r / group - pos + 1;  // keys of this block row r sees
        for (int64_t t = std::max<int64_t>(visible, 0); t < n; ++t) scores[r * B + t] = kNegInf;
        softmax_update(scores + r * B, n, w.max_score[r], w.exp_sum[r], acc + r * D, D);
        if constexpr (kPerTokenScales)
          for (int64_t t = 0; t < n; ++t) scores[r * B + t] *= kv_scales.value[row / D + t];
      }
      with_tile(gt, [&](auto tile) {
#if defined(__AVX512BF16__)
        if constexpr (std::is_same_v<T, c10::BFloat16>)
          if (bf16_dot) return tile.accumulate_bf16(scores + r0 * B, B, v, n, D, acc + r0 * D, next_v);
#endif
        tile.accumulate(scores + r0 * B, B, v, n, D, acc + r0 * D, next_v);
      });
    }
  }
  // Every row saw key 0, so its sum is positive.
  for (int64_t r = 0; r < rows; ++r) {
    float* a = acc + r * D;
    if (bf16_dot) from_unpack_order(a, D);
    const float inv = kv_scales.value_layer / hsum(w.exp_sum[r]);
    Q* dst = out + ((q_begin + item.first_token + r / group) * num_heads + h0 + r % group) * D;
    for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<Q>(a[d] * inv);
  }
}

at::Tensor paged_attention_prefill_cpu(const at::Tensor& query, const at::Tensor& key_cache,
                                       const at::Tensor& value_cache, const at::Tensor& block_tables,
                                       const at::Tensor& cu_seqlens_q, const at::Tensor& seq_lens, double scale,
                                       std::optional<int64_t> max_query_len, const std::optional<at::Tensor>& key_scale,
                                       const std::optional<at::Tensor>& value_scale) {
  const CacheLayout layout =
      check_paged_attention_prefill(query, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens);
  const KVFormat format = check_kv_scales(key_cache, layout, key_scale, value_scale);
  const LayerScales layer = check_layer_scale_values(format, key_scale, value_scale);
  KVScales kv_scales{nullptr, nullptr, raw_scale(format, layer.key), raw_scale(format, layer.value)};
  if (format == KVFormat::kInt8) kv_scales.key = key_scale->const_data_ptr<float>(), kv_scales.value = value_scale->const_data_ptr<float>();
  const int64_t longest = check_prefill_ranges(block_tables, cu_seqlens_q, seq_lens, query.size(0), layout);
  if (max_query_len.has_value())
    TORCH_CHECK_VALUE(longest <= *max_query_len, "max_query_len: ", *max_query_len,
                      " is smaller than the most new tokens of a sequence in cu_seqlens_q (", longest, ")");
  const at::Tensor lens = seq_lens.contiguous(), cu = cu_seqlens_q.contiguous(), tables = block_tables.contiguous();
  const int32_t* lens_ptr = lens.const_data_ptr<int32_t>();
  const int32_t* cu_ptr = cu.const_data_ptr<int32_t>();
  const int64_t num_heads = query.size(1), D = layout.head_dim, group = num_heads / layout.num_kv_heads;
  // An 8-bit cache's kernels take a float query and give a float output (converted back at the end).
  const at::ScalarType compute_dtype = format == KVFormat::kNone ? query.scalar_type() : at::kFloat;
  at::Tensor out = at::empty({query.size(0), num_heads, D}, query.options().dtype(compute_dtype));
  // The query is read row by row in place (any strides) unless its head_dim is strided.
  const at::Tensor q = query.stride(2) == 1 && query.scalar_type() == compute_dtype ? query
                                                                                    : query.to(compute_dtype).contiguous();

  // Tiles of whole tokens with all heads of a group; the most expensive (latest, longest
  // context) first, so that the cheap ones fill the gaps at the end.
  const int64_t tile_tokens = std::max<int64_t>(1, kTileRows / group);
  std::vector<PrefillItem> items;
  for (int64_t s = 0; s < seq_lens.size(0); ++s) {
    const int64_t new_tokens = cu_ptr[s + 1] - cu_ptr[s], context = lens_ptr[s] - new_tokens;
    for (int64_t t = 0; t < new_tokens; t += tile_tokens) {
      const int64_t n = std::min(tile_tokens, new_tokens - t);
      for (int64_t h = 0; h < layout.num_kv_heads; ++h) items.push_back({s, t, n, h, (context + t + n) * n});
    }
  }
  std::stable_sort(items.begin(), items.end(), [](const auto& a, const auto& b) { return a.cost > b.cost; });

  // Runs every work item with query type Q and cache type T.
  auto run = [&](auto* query_type, auto* cache_type) {
    using Q = std::remove_pointer_t<decltype(query_type)>;
    using T = std::remove_pointer_t<decltype(cache_type)>;
    const T* kc = static_cast<const T*>(key_cache.const_data_ptr());
    const T* vc = static_cast<const T*>(value_cache.const_data_ptr());
    const Q* qp = static_cast<const Q*>(q.const_data_ptr());
    Q* op = static_cast<Q*>(out.data_ptr());
    const int64_t num_items = static_cast<int64_t>(items.size());
    std::atomic<int64_t> next_item{0};
    at::parallel_for(0, std::min<int64_t>(num_items, at::get_num_threads()), 1, [&](int64_t, int64_t) {
      TileScratch scratch;
      for (int64_t i; (i = next_item.fetch_add(1, std::memory_order_relaxed)) < num_items;) {
        const PrefillItem& item = items[i];
        const int64_t new_tokens = cu_ptr[item.seq + 1] - cu_ptr[item.seq];
        prefill_work_item<Q, T>(item, qp, q.stride(0), q.stride(1), cu_ptr[item.seq], lens_ptr[item.seq] - new_tokens,
                                static_cast<float>(scale), kc, vc, layout,
                                tables.const_data_ptr<int32_t>() + item.seq * tables.size(1), group, op, num_heads,
                                scratch, kv_scales);
      }
    });
  };
  switch (format) {
    case KVFormat::kInt8: run(static_cast<float*>(nullptr), static_cast<int8_t*>(nullptr)); break;
    case KVFormat::kFp8E4M3: run(static_cast<float*>(nullptr), static_cast<fp8_e4m3*>(nullptr)); break;
    case KVFormat::kFp8E5M2: run(static_cast<float*>(nullptr), static_cast<fp8_e5m2*>(nullptr)); break;
    case KVFormat::kNone:
      MINIPAGED_DISPATCH(query.scalar_type(), "paged_attention_prefill_cpu",
                         [&] { run(static_cast<scalar_t*>(nullptr), static_cast<scalar_t*>(nullptr)); });
  }
  return out.scalar_type() == query.scalar_type() ? out : out.to(query.scalar_type());
}

}  // namespace

MINIPAGED_CPU_IMPL(m) { m.impl("paged_attention_prefill", &paged_attention_prefill_cpu); }

}  // namespace minipaged::MINIPAGED_CPU_ISA
