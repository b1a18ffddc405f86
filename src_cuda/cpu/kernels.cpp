// CPU kernels. Decode attention is memory-bound, so the plan is to read every K/V byte once:
// work items are (sequence, partition of the context) and walk each block front to back over
// its kv heads, all query heads of a GQA group are handled together, and a softmax that is
// online across blocks keeps one pass over K/V.
// Partitions let a single long sequence use every core; their partial results are merged
// afterwards with the usual (max, sum) rescaling.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "cache_layout.h"
#include "checks.h"
#include "cpu/vec.h"

namespace minipaged {
namespace {

constexpr int64_t kPartitionTokens = 512;  // most tokens per work item along the context

// Running softmax state of one work item: per query head of the sequence, the max score seen,
// the sum of exp(score - max), and the exp-weighted sum of V rows.
struct Partial {
  float* max_score;  // [num_heads]
  float* exp_sum;    // [num_heads]
  float* acc;        // [num_heads, head_dim]
};

// One sequence, tokens [begin, end), every kv head. Heads are the inner loop so that each block
// is read front to back: its K rows for all heads are one contiguous run, and so are its V
// rows. Scattered 8 KB pieces (one head of one block) are much slower to stream from memory.
template <typename T>
void decode_work_item(const float* q,  // [num_heads, head_dim] of this sequence, already scaled
                      const T* q_raw, float scale,  // the same, as given (unscaled, cache dtype)
                      const T* key_cache, const T* value_cache, const CacheLayout& layout,
                      const int32_t* block_table, int64_t begin, int64_t end, int64_t group, Partial out,
                      std::vector<float>& scratch) {
  const int64_t D = layout.head_dim, B = layout.block_size, num_heads = layout.num_kv_heads * group;
#if defined(__AVX512BF16__)
  const bool bf16_dot = std::is_same_v<T, c10::BFloat16> && D % 32 == 0 && B <= 256;
#else
  const bool bf16_dot = false;
#endif
  scratch.assign(kMaxTile * B + num_heads * kW, 0.f);
  float* scores = scratch.data();  // [tile heads, B]
  auto* exp_sums = reinterpret_cast<f32x16*>(scores + kMaxTile * B);  // [num_heads], per lane
  std::fill(out.max_score, out.max_score + num_heads, -std::numeric_limits<float>::infinity());
  std::fill(out.acc, out.acc + num_heads * D, 0.f);

  // Blocks are scattered, so the hardware prefetcher cannot find the next one. While a kv head
  // of one block is computed, its rows of the next block are asked for, a few at a time (see
  // RowPrefetch); the first block is asked for at once. Measured with cold caches at block
  // sizes 8, 16 and 32, one block ahead beat two or four, and beat asking for the whole next
  // block at once.
  if (begin < end) {
    const int64_t r = layout.row(block_table[begin / B], 0, 0);
    const int64_t block_bytes = layout.block_elems() * static_cast<int64_t>(sizeof(T));
    prefetch(reinterpret_cast<const char*>(key_cache + r), block_bytes);
    prefetch(reinterpret_cast<const char*>(value_cache + r), block_bytes);
  }

  for (int64_t pos = begin; pos < end;) {
    const int64_t block = block_table[pos / B];
    const int64_t first = pos % B;
    const int64_t n = std::min(B - first, end - pos);
    const int64_t later = pos - first + B;  // first token of the next block
    for (int64_t kv_head = 0; kv_head < layout.num_kv_heads; ++kv_head) {
      const int64_t row = layout.row(block, kv_head, first);
      const T* k = key_cache + row;
      const T* v = value_cache + row;
      const int64_t h0 = kv_head * group;
      RowPrefetch next_k, next_v;
      if (later < end) {
        const int64_t next = layout.row(block_table[later / B], kv_head, 0);
        const int64_t row_bytes = D * static_cast<int64_t>(sizeof(T));
        next_k = RowPrefetch{reinterpret_cast<const char*>(key_cache + next), row_bytes, B};
        next_v = RowPrefetch{reinterpret_cast<const char*>(value_cache + next), row_bytes, B};
      }
      for (int64_t g0 = h0; g0 < h0 + group; g0 += kMaxTile) {  // one tile unless group > 8
        const int64_t gt = std::min(kMaxTile, h0 + group - g0);
        with_tile(gt, [&](auto tile) {
#if defined(__AVX512BF16__)
          if constexpr (std::is_same_v<T, c10::BFloat16>)
            if (bf16_dot) return tile.scores_bf16(q_raw + g0 * D, scale, k, n, D, scores, B, next_k);
#endif
          tile.scores(q + g0 * D, k, n, D, scores, B, next_k);
        });
        for (int64_t g = 0; g < gt; ++g)
          softmax_update(scores + g * B, n, out.max_score[g0 + g], exp_sums[g0 + g], out.acc + (g0 + g) * D, D);
        with_tile(gt, [&](auto tile) {
#if defined(__AVX512BF16__)
          if constexpr (std::is_same_v<T, c10::BFloat16>)
            if (bf16_dot) return tile.accumulate_bf16(scores, B, v, n, D, out.acc + g0 * D, next_v);
#endif
          tile.accumulate(scores, B, v, n, D, out.acc + g0 * D, next_v);
        });
      }
    }
    pos += n;
  }
  for (int64_t h = 0; h < num_heads; ++h) out.exp_sum[h] = hsum(exp_sums[h]);
  if (bf16_dot)
    for (int64_t h = 0; h < num_heads; ++h) from_unpack_order(out.acc + h * D, D);
}

at::Tensor paged_attention_decode_cpu(const at::Tensor& query, const at::Tensor& key_cache,
                                      const at::Tensor& value_cache, const at::Tensor& block_tables,
                                      const at::Tensor& seq_lens, double scale,
                                      std::optional<int64_t> max_seq_len) {
  const CacheLayout layout = check_paged_attention_decode(query, key_cache, value_cache, block_tables, seq_lens);
  check_decode_ranges(block_tables, seq_lens, layout);
  const at::Tensor lens = seq_lens.contiguous();
  const int32_t* lens_ptr = lens.data_ptr<int32_t>();
  const int64_t num_seqs = query.size(0), num_heads = query.size(1), D = layout.head_dim;
  const int64_t group = num_heads / layout.num_kv_heads;
  int64_t longest = 0;
  for (int64_t s = 0; s < num_seqs; ++s) longest = std::max<int64_t>(longest, lens_ptr[s]);
  if (max_seq_len.has_value())
    TORCH_CHECK_VALUE(longest <= *max_seq_len, "max_seq_len: ", *max_seq_len,
                      " is smaller than the longest sequence in seq_lens (", longest, ")");

  // Work items are (sequence, partition of whole blocks). Partitions are at most 512 tokens,
  // and shorter when there are too few items to keep every thread busy.
  const int64_t B = layout.block_size;
  const int64_t wanted_parts = (4 * at::get_num_threads() + num_seqs - 1) / std::max<int64_t>(num_seqs, 1);
  const int64_t part_cap = std::max<int64_t>(1, kPartitionTokens / B) * B;
  const int64_t part = std::clamp<int64_t>((longest / std::max<int64_t>(wanted_parts, 1) + B - 1) / B * B, B, part_cap);
  const int64_t num_parts = std::max<int64_t>(1, (longest + part - 1) / part);
  const at::Tensor q_raw = query.contiguous();
  const at::Tensor tables = block_tables.contiguous();
  at::Tensor max_score = at::empty({num_seqs, num_heads, num_parts}, query.options().dtype(at::kFloat));
  at::Tensor exp_sum = at::zeros_like(max_score);
  at::Tensor acc = at::empty({num_seqs, num_heads, num_parts, D}, max_score.options());
  at::Tensor out = at::empty({num_seqs, num_heads, D}, query.options());

  MINIPAGED_DISPATCH(query.scalar_type(), "paged_attention_decode_cpu", [&] {
    const scalar_t* kc = key_cache.const_data_ptr<scalar_t>();
    const scalar_t* vc = value_cache.const_data_ptr<scalar_t>();
    const scalar_t* qp = q_raw.const_data_ptr<scalar_t>();
    float* mp = max_score.data_ptr<float>();
    float* ep = exp_sum.data_ptr<float>();
    float* ap = acc.data_ptr<float>();
    const int64_t items = num_seqs * num_parts;
    // Work items are handed out one at a time from a shared counter rather than in fixed
    // slices: ragged sequences, and a core the OS takes away for a moment, then cost only
    // one item of imbalance instead of a whole slice.
    std::atomic<int64_t> next_item{0};
    at::parallel_for(0, std::min<int64_t>(items, at::get_num_threads()), 1, [&](int64_t, int64_t) {
      std::vector<float> scratch, q(num_heads * D), m(num_heads), l(num_heads), a(num_heads * D);
      for (int64_t item; (item = next_item.fetch_add(1, std::memory_order_relaxed)) < items;) {
        const int64_t s = item / num_parts, p = item % num_parts;
        const int64_t begin = p * part, end = std::min<int64_t>(lens_ptr[s], begin + part);
        if (begin < end) {
          const scalar_t* q_seq = qp + s * num_heads * D;
          for (int64_t i = 0; i < num_heads * D; ++i) q[i] = static_cast<float>(q_seq[i]) * static_cast<float>(scale);
          decode_work_item<scalar_t>(q.data(), q_seq, static_cast<float>(scale), kc, vc, layout,
                                     tables.const_data_ptr<int32_t>() + s * tables.size(1), begin, end, group,
                                     Partial{m.data(), l.data(), a.data()}, scratch);
        }
        for (int64_t h = 0; h < num_heads; ++h) {
          const int64_t idx = (s * num_heads + h) * num_parts + p;
          mp[idx] = begin < end ? m[h] : -std::numeric_limits<float>::infinity();
          ep[idx] = begin < end ? l[h] : 0.f;
          if (begin < end) std::memcpy(ap + idx * D, a.data() + h * D, D * sizeof(float));
        }
      }
    });
    // Merge partitions: rescale each partial to the global max, then normalise.
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, num_seqs * num_heads, 16, [&](int64_t lo, int64_t hi) {
      std::vector<float> row(D);
      for (int64_t sh = lo; sh < hi; ++sh) {
        const float* m = mp + sh * num_parts;
        const float* l = ep + sh * num_parts;
        const float global_max = *std::max_element(m, m + num_parts);
        std::fill(row.begin(), row.end(), 0.f);
        float total = 0.f;
        for (int64_t p = 0; p < num_parts; ++p) {
          if (l[p] == 0.f) continue;
          const float w = std::exp(m[p] - global_max);
          total += w * l[p];
          axpy(w, ap + (sh * num_parts + p) * D, row.data(), D);
        }
        const float inv = total > 0.f ? 1.f / total : 0.f;
        for (int64_t d = 0; d < D; ++d) op[sh * D + d] = static_cast<scalar_t>(row[d] * inv);
      }
    });
  });
  return out;
}

void reshape_and_cache_cpu(const at::Tensor& key, const at::Tensor& value, at::Tensor& key_cache,
                           at::Tensor& value_cache, const at::Tensor& slot_mapping) {
  const CacheLayout layout = check_reshape_and_cache(key, value, key_cache, value_cache, slot_mapping);
  check_slot_range(slot_mapping, layout);
  const at::Tensor slots = slot_mapping.to(at::kLong).contiguous();
  const int64_t* sp = slots.const_data_ptr<int64_t>();
  const int64_t D = layout.head_dim;
  MINIPAGED_DISPATCH(key.scalar_type(), "reshape_and_cache_cpu", [&] {
    // One token's rows for every kv head; pointers and strides are read once, outside the loop.
    struct Source {
      const scalar_t* data;
      int64_t token_stride, head_stride, dim_stride;
    };
    const Source sources[2] = {{key.const_data_ptr<scalar_t>(), key.stride(0), key.stride(1), key.stride(2)},
                               {value.const_data_ptr<scalar_t>(), value.stride(0), value.stride(1), value.stride(2)}};
    auto write = [&](const Source& src, scalar_t* dst_base, int64_t i) {
      for (int64_t h = 0; h < layout.num_kv_heads; ++h) {
        const scalar_t* from = src.data + i * src.token_stride + h * src.head_stride;
        scalar_t* to = dst_base + layout.slot_row(sp[i], h);
        if (src.dim_stride == 1) {
          std::memcpy(to, from, D * sizeof(scalar_t));
        } else {
          for (int64_t d = 0; d < D; ++d) to[d] = from[d * src.dim_stride];
        }
      }
    };
    scalar_t* kc = key_cache.data_ptr<scalar_t>();
    scalar_t* vc = value_cache.data_ptr<scalar_t>();
    at::parallel_for(0, key.size(0), 64, [&](int64_t lo, int64_t hi) {
      for (int64_t i = lo; i < hi; ++i) {
        if (sp[i] < 0) continue;
        write(sources[0], kc, i);
        write(sources[1], vc, i);
      }
    });
  });
}

void copy_blocks_cpu(at::Tensor& key_cache, at::Tensor& value_cache, const at::Tensor& block_mapping) {
  const CacheLayout layout = check_copy_blocks(key_cache, value_cache, block_mapping);
  check_copy_ranges(block_mapping, layout);
  const at::Tensor pairs = block_mapping.contiguous();
  const int64_t* p = pairs.const_data_ptr<int64_t>();
  const int64_t bytes = layout.block_elems() * key_cache.element_size();
  auto* kc = static_cast<char*>(key_cache.data_ptr());
  auto* vc = static_cast<char*>(value_cache.data_ptr());
  at::parallel_for(0, pairs.size(0), 1, [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) {
      std::memcpy(kc + p[2 * i + 1] * bytes, kc + p[2 * i] * bytes, bytes);
      std::memcpy(vc + p[2 * i + 1] * bytes, vc + p[2 * i] * bytes, bytes);
    }
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(minipaged, CPU, m) {
  m.impl("reshape_and_cache", &reshape_and_cache_cpu);
  m.impl("paged_attention_decode", &paged_attention_decode_cpu);
  m.impl("copy_blocks", &copy_blocks_cpu);
}

}  // namespace minipaged
