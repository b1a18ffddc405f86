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
#include "cpu/isa.h"
#include "cpu/vec.h"

namespace minipaged::MINIPAGED_CPU_ISA {
namespace {

// Query rows per work item. 64 rows x 128 floats is 32 KiB of accumulator plus as much query:
// L1/L2-resident, and each K/V row is reused 64 times per load.
constexpr int64_t kTileRows = 64;

#if defined(__AVX512F__) && !defined(MINIPAGED_PREFILL_TRANSPOSED)
#define MINIPAGED_PREFILL_TRANSPOSED 1
#elif !defined(MINIPAGED_PREFILL_TRANSPOSED)
#define MINIPAGED_PREFILL_TRANSPOSED 0
#endif

struct PrefillItem {
  int64_t seq, first_token, num_tokens, kv_head;  // tokens are new-token indices of the sequence
  int64_t cost;                                     // keys read x rows, for scheduling
};

// Per-thread buffers of one work item; rows are (token, head in group), token-major.
struct TileScratch {
  std::vector<float> q, scores, max_score, acc;
  std::vector<f32x16> exp_sum;
  std::vector<c10::BFloat16> q_bf16;
  std::vector<float> kt;  // one block's keys, transposed 16 at a time
};

#if defined(__AVX512F__)
// Q.K for a tile of R query rows against up to 16 keys whose rows were transposed into `kt`
// ([D][16] floats, or [D/2][16] bfloat16 pairs): one key vector per head-dim step, the query
// element broadcast, no horizontal sums. The decode kernel's HeadTile keeps the key row
// layout and pays a horizontal sum per (key, row), which is fine when K is streamed once per
// query, but here the same block meets 64 query rows, so transposing it once per block pays.
template <int R>
void scores_transposed(const float* q, const float* kt, int64_t D, int64_t n, float* scores, int64_t stride) {
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t d = 0; d < D; ++d) {
    const __m512 kv = _mm512_loadu_ps(kt + d * 16);
    for (int r = 0; r < R; ++r) acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(q[r * D + d]), kv, acc[r]);
  }
  const __mmask16 live = n >= 16 ? 0xFFFF : (1u << n) - 1;
  for (int r = 0; r < R; ++r) _mm512_mask_storeu_ps(scores + r * stride, live, acc[r]);
}
#if defined(__AVX512BF16__)
template <int R>
void scores_transposed_bf16(const uint32_t* q_pairs, float scale, const uint32_t* kt, int64_t D, int64_t n,
                            float* scores, int64_t stride) {
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t p = 0; p < D / 2; ++p) {
    const __m512bh kv = (__m512bh)_mm512_loadu_si512(kt + p * 16);
    for (int r = 0; r < R; ++r)
      acc[r] = _mm512_dpbf16_ps(acc[r], (__m512bh)_mm512_set1_epi32(static_cast<int>(q_pairs[r * D / 2 + p])), kv);
  }
  const __mmask16 live = n >= 16 ? 0xFFFF : (1u << n) - 1;
  for (int r = 0; r < R; ++r) _mm512_mask_storeu_ps(scores + r * stride, live, _mm512_mul_ps(acc[r], _mm512_set1_ps(scale)));
}
#endif

// Transposes up to 16 key rows (n of them, row stride D elements) into `kt` by gathers: floats
// as they are, bfloat16 as (d, d+1) pairs. Keys past n read row n - 1 (never used).
inline void transpose_keys(const float* k, int64_t n, int64_t D, float* kt) {
  const __m512i rows = _mm512_mullo_epi32(_mm512_min_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                                           _mm512_set1_epi32(static_cast<int>(n - 1))),
                                          _mm512_set1_epi32(static_cast<int>(D)));
  for (int64_t d = 0; d < D; ++d) _mm512_storeu_ps(kt + d * 16, _mm512_i32gather_ps(rows, k + d, 4));
}
inline void transpose_keys(const c10::BFloat16* k, int64_t n, int64_t D, uint32_t* kt) {
  const __m512i rows = _mm512_mullo_epi32(_mm512_min_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                                           _mm512_set1_epi32(static_cast<int>(n - 1))),
                                          _mm512_set1_epi32(static_cast<int>(D / 2)));
  const int* pairs = reinterpret_cast<const int*>(k);
  for (int64_t p = 0; p < D / 2; ++p) _mm512_storeu_si512(kt + p * 16, _mm512_i32gather_epi32(rows, pairs + p, 4));
}
#endif

template <int G>
constexpr int tile_rows(HeadTile<G>) { return G; }

template <typename T>
void prefill_work_item(const PrefillItem& item, const T* query, int64_t q_token_stride, int64_t q_head_stride,
                       int64_t q_begin, int64_t context, float scale, const T* key_cache, const T* value_cache,
                       const CacheLayout& layout, const int32_t* block_table, int64_t group, T* out,
                       int64_t num_heads, TileScratch& w) {
  const int64_t D = layout.head_dim, B = layout.block_size;
  const int64_t rows = item.num_tokens * group, h0 = item.kv_head * group;
#if defined(__AVX512BF16__)
  const bool bf16_dot = std::is_same_v<T, c10::BFloat16> && D % 32 == 0 && B <= 256;
#else
  const bool bf16_dot = false;
#endif
  // Keys transposed per block for the Q.K tile (AVX-512: float32, and bfloat16 with its pair dot
  // product); worth it only when enough query rows share the block.
  [[maybe_unused]] const bool transposed = MINIPAGED_PREFILL_TRANSPOSED && (std::is_same_v<T, float> || bf16_dot) && rows >= 16;
  w.q.resize(rows * D);
  w.scores.resize(rows * B);
  w.max_score.assign(rows, -std::numeric_limits<float>::infinity());
  w.exp_sum.assign(rows, f32x16{});
  w.acc.assign(rows * D, 0.f);
  if (bf16_dot) w.q_bf16.resize(rows * D);
  for (int64_t r = 0; r < rows; ++r) {
    const T* src = query + (q_begin + item.first_token + r / group) * q_token_stride + (h0 + r % group) * q_head_stride;
    for (int64_t d = 0; d < D; ++d) w.q[r * D + d] = static_cast<float>(src[d]) * scale;
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
      next_k = RowPrefetch{reinterpret_cast<const char*>(key_cache + next), row_bytes, B};
      next_v = RowPrefetch{reinterpret_cast<const char*>(value_cache + next), row_bytes, B};
    }
#if defined(__AVX512F__)
    if (transposed) {
      const int64_t chunks = (n + 15) / 16, chunk_elems = bf16_dot ? D / 2 * 16 : D * 16;
      w.kt.resize(chunks * chunk_elems);
      for (int64_t c = 0; c < chunks; ++c) {
        if constexpr (std::is_same_v<T, float>)
          transpose_keys(k + c * 16 * D, std::min<int64_t>(16, n - c * 16), D, reinterpret_cast<float*>(w.kt.data()) + c * chunk_elems);
        if constexpr (std::is_same_v<T, c10::BFloat16>)
          transpose_keys(k + c * 16 * D, std::min<int64_t>(16, n - c * 16), D, reinterpret_cast<uint32_t*>(w.kt.data()) + c * chunk_elems);
      }
      next_k.upto(B);
    }
#endif
    for (int64_t r0 = live; r0 < rows; r0 += kMaxTile) {
      const int64_t gt = std::min(kMaxTile, rows - r0);
      with_tile(gt, [&](auto tile) {
#if defined(__AVX512F__)
        if (transposed) {
          constexpr int R = tile_rows(decltype(tile){});
          const int64_t chunk_elems = bf16_dot ? D / 2 * 16 : D * 16;
          for (int64_t c = 0; c * 16 < n; ++c) {
            const int64_t m = std::min<int64_t>(16, n - c * 16);
#if defined(__AVX512BF16__)
            if (bf16_dot) {
              scores_transposed_bf16<R>(reinterpret_cast<const uint32_t*>(w.q_bf16.data() + r0 * D), scale,
                                        reinterpret_cast<const uint32_t*>(w.kt.data()) + c * chunk_elems, D, m,
                                        scores + r0 * B + c * 16, B);
              continue;
            }
#endif
            scores_transposed<R>(w.q.data() + r0 * D, reinterpret_cast<const float*>(w.kt.data()) + c * chunk_elems, D, m,
                                 scores + r0 * B + c * 16, B);
          }
          return;
        }
#endif
#if defined(__AVX512BF16__)
        if constexpr (std::is_same_v<T, c10::BFloat16>)
          if (bf16_dot) return tile.scores_bf16(w.q_bf16.data() + r0 * D, scale, k, n, D, scores + r0 * B, B, next_k);
#endif
        tile.scores(w.q.data() + r0 * D, k, n, D, scores + r0 * B, B, next_k);
      });
      for (int64_t r = r0; r < r0 + gt; ++r) {
        const int64_t visible = first_pos + r / group - pos + 1;  // keys of this block row r sees
        for (int64_t t = std::max<int64_t>(visible, 0); t < n; ++t) scores[r * B + t] = kNegInf;
        softmax_update(scores + r * B, n, w.max_score[r], w.exp_sum[r], acc + r * D, D);
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
    const float inv = 1.f / hsum(w.exp_sum[r]);
    T* dst = out + ((q_begin + item.first_token + r / group) * num_heads + h0 + r % group) * D;
    for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<T>(a[d] * inv);
  }
}

at::Tensor paged_attention_prefill_cpu(const at::Tensor& query, const at::Tensor& key_cache,
                                       const at::Tensor& value_cache, const at::Tensor& block_tables,
                                       const at::Tensor& cu_seqlens_q, const at::Tensor& seq_lens, double scale,
                                       std::optional<int64_t> max_query_len) {
  const CacheLayout layout =
      check_paged_attention_prefill(query, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens);
  const int64_t longest = check_prefill_ranges(block_tables, cu_seqlens_q, seq_lens, query.size(0), layout);
  if (max_query_len.has_value())
    TORCH_CHECK_VALUE(longest <= *max_query_len, "max_query_len: ", *max_query_len,
                      " is smaller than the most new tokens of a sequence in cu_seqlens_q (", longest, ")");
  const at::Tensor lens = seq_lens.contiguous(), cu = cu_seqlens_q.contiguous(), tables = block_tables.contiguous();
  const int32_t* lens_ptr = lens.const_data_ptr<int32_t>();
  const int32_t* cu_ptr = cu.const_data_ptr<int32_t>();
  const int64_t num_heads = query.size(1), D = layout.head_dim, group = num_heads / layout.num_kv_heads;
  at::Tensor out = at::empty({query.size(0), num_heads, D}, query.options());
  // The query is read row by row in place (any strides) unless its head_dim is strided.
  const at::Tensor q = query.stride(2) == 1 ? query : query.contiguous();

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

  MINIPAGED_DISPATCH(query.scalar_type(), "paged_attention_prefill_cpu", [&] {
    const scalar_t* kc = key_cache.const_data_ptr<scalar_t>();
    const scalar_t* vc = value_cache.const_data_ptr<scalar_t>();
    const scalar_t* qp = q.const_data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    const int64_t num_items = static_cast<int64_t>(items.size());
    std::atomic<int64_t> next_item{0};
    at::parallel_for(0, std::min<int64_t>(num_items, at::get_num_threads()), 1, [&](int64_t, int64_t) {
      TileScratch scratch;
      for (int64_t i; (i = next_item.fetch_add(1, std::memory_order_relaxed)) < num_items;) {
        const PrefillItem& item = items[i];
        const int64_t new_tokens = cu_ptr[item.seq + 1] - cu_ptr[item.seq];
        prefill_work_item<scalar_t>(item, qp, q.stride(0), q.stride(1), cu_ptr[item.seq],
                                    lens_ptr[item.seq] - new_tokens, static_cast<float>(scale), kc, vc, layout,
                                    tables.const_data_ptr<int32_t>() + item.seq * tables.size(1), group, op,
                                    num_heads, scratch);
      }
    });
  });
  return out;
}

}  // namespace

MINIPAGED_CPU_IMPL(m) { m.impl("paged_attention_prefill", &paged_attention_prefill_cpu); }

}  // namespace minipaged::MINIPAGED_CPU_ISA
