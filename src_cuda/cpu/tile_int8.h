// The 16-bit integer pair path of a head tile (head_tile.h): int8 caches with a 16-bit query, Q.K
// and P.V as 16-bit integer pair dot products (lanes.h's pairs_dot: vpdpwssd on AVX512-VNNI,
// vpmaddwd and an add on AVX2). Each K/V row widens from int8 in one instruction instead of the two
// (widen, convert) that float multiply-adds need, and a pair dot product does two products.
#pragma once

#include "cpu/lanes.h"
#include "cpu/row_prefetch.h"
#include "cpu/vec.h"

namespace minipaged {
namespace {

#if defined(MINIPAGED_INT16_PAIRS)
// The query of an int8 work item for HeadTile::scores_int8: each head's row rounded to int16
// against its largest element (q16 = round(q / q_scale), |q16| <= 32767: an error below 2^-16 of
// that element, less than the float16 / bfloat16 rounding the query came with). A row with a NaN or
// infinity gets a NaN scale, so its scores are NaN as in the float kernels. D a multiple of kLanes.
inline void quantize_query(const float* q, int64_t num_heads, int64_t D, int16_t* q16, float* q_scale) {
  for (int64_t h = 0; h < num_heads; ++h) {
    const float* row = q + h * D;
    Lanes top = lanes_zero();
    for (int64_t d = 0; d < D; d += kLanes) top = lanes_max(top, lanes_abs(lanes_loadu(row + d)));
    float largest = lanes_hmax(top);  // vmaxps passes a NaN through from its second operand only
    for (int64_t d = 0; d < D; ++d) largest = std::isfinite(row[d]) ? largest : std::numeric_limits<float>::quiet_NaN();
    q_scale[h] = largest > 0.f || std::isnan(largest) ? largest * (1.f / 32767.f) : 1.f;
    const Lanes inv = lanes_set1(largest > 0.f ? 32767.f / largest : 0.f);
    for (int64_t d = 0; d < D; d += kLanes) lanes_store_int16(q16 + h * D + d, lanes_mul(lanes_loadu(row + d), inv));
  }
}

// The largest GQA group this path takes: on AVX2 a larger one's P.V sums would not fit the 16
// registers (the float path takes it).
constexpr int64_t kInt8MaxGroup = kLanes == 16 ? 8 : 4;

template <int GT>
struct Int8Tile {
  static constexpr int64_t kChunk = 2 * kLanes;  // int16 columns per pair vector
  // Query heads per pass of four tokens: 4 x H sums, H query chunks and a K chunk in registers.
  static constexpr int kHeads = kLanes == 16 ? 4 : 2;

  // scores[g][t] = q_scale[g] * k_scales[t] * (q16[g] . k[t]), the dot products exact in int32.
  // D a multiple of kChunk, at most 512 (no int32 overflow).
  static void scores_int8(const int16_t* q16, const float* q_scale, const int8_t* k, const float* k_scales, int64_t n,
                          int64_t D, float* scores, int64_t stride, RowPrefetch& pf) {
    int64_t t = 0;
    if (D == 128) t = tokens_by_four_int8<128 / kChunk>(q16, q_scale, k, k_scales, n, scores, stride, pf);
    if (D == 64) t = tokens_by_four_int8<64 / kChunk>(q16, q_scale, k, k_scales, n, scores, stride, pf);
    if (D == 256) t = tokens_by_four_int8<256 / kChunk>(q16, q_scale, k, k_scales, n, scores, stride, pf);
    for (; t < n; ++t) {
      pf.upto(t + 1);
      PairInts a[GT];
      for (int g = 0; g < GT; ++g) a[g] = pairs_zero();
      for (int64_t d = 0; d < D; d += kChunk) {
        const PairInts kv = pairs_widen_int8(k + t * D + d);
        for (int g = 0; g < GT; ++g) a[g] = pairs_dot(a[g], kv, pairs_load(q16 + g * D + d));
      }
      const PairInts zero = pairs_zero();
      for (int g = 0; g < GT; ++g)
        scores[g * stride + t] = static_cast<float>(pairs_hsum4(a[g], zero, zero, zero)[0]) * (q_scale[g] * k_scales[t]);
    }
  }
  template <int DC>  // DC = head_dim / kChunk
  static int64_t tokens_by_four_int8(const int16_t* q16, const float* q_scale, const int8_t* k, const float* k_scales,
                                     int64_t n, float* scores, int64_t stride, RowPrefetch& pf) {
    int64_t t = 0;
    for (; t + 4 <= n; t += 4) {
      pf.upto(t + 4);
      head_groups_int8<DC, 0>(q16, q_scale, k + t * DC * kChunk, k_scales + t, scores + t, stride);
    }
    return t;
  }
  template <int DC, int G0>
  __attribute__((always_inline)) static void head_groups_int8(const int16_t* q16, const float* q_scale, const int8_t* k,
                                                              const float* k_scales, float* scores, int64_t stride) {
    constexpr int H = GT - G0 < kHeads ? GT - G0 : kHeads;
    four_tokens_int8<DC, H>(q16 + G0 * DC * kChunk, q_scale + G0, k, k_scales, scores + G0 * stride, stride);
    if constexpr (G0 + H < GT) head_groups_int8<DC, G0 + H>(q16, q_scale, k, k_scales, scores, stride);
  }
  // Four tokens (rows of k) against H query heads, each chunk of the query loaded once for the four.
  template <int DC, int H>
  static void four_tokens_int8(const int16_t* q16, const float* q_scale, const int8_t* k, const float* k_scales,
                               float* scores, int64_t stride) {
    constexpr int64_t D = DC * kChunk;
    PairInts a[4][H];
    auto chunk = [&](int c, auto first) __attribute__((always_inline)) {
      PairInts qv[H];
      for (int h = 0; h < H; ++h) qv[h] = pairs_load(q16 + h * D + c * kChunk);
      for (int i = 0; i < 4; ++i) {
        const PairInts kv = pairs_widen_int8(k + i * D + c * kChunk);
        for (int h = 0; h < H; ++h) a[i][h] = pairs_dot(first ? pairs_zero() : a[i][h], kv, qv[h]);
      }
    };
    chunk(0, std::true_type{});
    // Unrolled whole, GCC hoists AVX2's widenings and products ahead of their adds and spills.
#pragma GCC unroll 2
    for (int c = 1; c < DC; ++c) chunk(c, std::false_type{});
    f32x4 token_scales;
    std::memcpy(&token_scales, k_scales, sizeof(token_scales));
    for (int h = 0; h < H; ++h) {
      const i32x4 sums = pairs_hsum4(a[0][h], a[1][h], a[2][h], a[3][h]);  // exact
      const f32x4 s = __builtin_convertvector(sums, f32x4) * (token_scales * q_scale[h]);
      std::memcpy(scores + h * stride, &s, sizeof(s));
    }
  }
  // acc[g] += sum_t p[g][t] * v_scales[t] * v[t] for int8 rows, two tokens per pair dot product as
  // in accumulate_bf16 (rows t and t+1 interleaved, the accumulators in unpack order, see
  // from_unpack_order). The weights w = p * v_scales are rounded to int16 per head against the
  // block's largest, w16 = round(w / w_scale): an error below 2^-16 of that weight, finer than the
  // bfloat16 rounding the bfloat16 kernel gives its probabilities. A block's products are summed
  // exactly in int32, then w_scale times the sums is added to acc. n <= 256.
  static void accumulate_int8(const float* p, int64_t stride, const int8_t* v, const float* v_scales, int64_t n,
                              int64_t D, float* acc, RowPrefetch& pf) {
    alignas(64) uint32_t packed[GT][kMaxPairs];  // (w16[2i], w16[2i+1]); a zero pads an odd n
    float w_scale[GT];
    for (int g = 0; g < GT; ++g) {
      const float* pg = p + g * stride;
      auto weights = [&](int64_t t) { return lanes_mul(lanes_load_first(pg + t, n - t), lanes_load_first(v_scales + t, n - t)); };
      Lanes top = lanes_zero();
      for (int64_t t = 0; t < n; t += kLanes) top = lanes_max(top, weights(t));
      const float largest = lanes_hmax(top);
      w_scale[g] = largest > 0.f ? largest * (1.f / 32767.f) : 1.f;
      const Lanes inv = lanes_set1(32767.f / (largest > 0.f ? largest : 32767.f));
      for (int64_t t = 0; t < n; t += kLanes)
        lanes_store_int16(reinterpret_cast<int16_t*>(packed[g]) + t, lanes_mul(weights(t), inv));
    }
    // C chunks per panel: 2 x GT x C sums in registers, enough to hide the dot product's latency,
    // beside the row pair, its two interleaves and the GT weights.
    constexpr int kBudget = kLanes == 16 ? 20 : 6;
    constexpr int C = 2 * GT * 4 <= kBudget ? 4 : 2 * GT * 2 <= kBudget ? 2 : 1;
    // Where a panel is narrower than a row (AVX2), the block is walked in windows of kWindowPairs
    // row pairs through every panel, so that V is read row by row (FloatTile::accumulate's reason).
    const int64_t num_pairs = (n + 1) / 2;
    const int64_t window = C * kChunk < D ? kWindowPairs : num_pairs;
    for (int64_t i0 = 0; i0 < num_pairs; i0 += window) {
      const int64_t i1 = std::min(num_pairs, i0 + window);
      int64_t d = 0;
      for (; d + C * kChunk <= D; d += C * kChunk)
        accumulate_int8_panel<C>(packed, w_scale, v, i0, i1, n, D, acc + d, d, pf);
      for (; d < D; d += kChunk) accumulate_int8_panel<1>(packed, w_scale, v, i0, i1, n, D, acc + d, d, pf);
    }
    pf.upto(pf.rows);
  }
  static constexpr int64_t kWindowPairs = 8;
  // Row pairs [i0, i1) of the block into acc's columns [d, d + C * kChunk).
  template <int C>
  static void accumulate_int8_panel(const uint32_t (*packed)[kMaxPairs], const float* w_scale, const int8_t* v,
                                    int64_t i0, int64_t i1, int64_t n, int64_t D, float* acc, int64_t d,
                                    RowPrefetch& pf) {
    PairInts lo_sum[GT][C], hi_sum[GT][C];
    v += d;
    // Only a window's first panel drives the prefetch stream (the others re-read its rows).
    auto pair = [&](int64_t i, auto first, auto prefetching) __attribute__((always_inline)) {
      if constexpr (prefetching) pf.upto(2 * i + 2);
      PairInts pp[GT];
#pragma GCC unroll 8
      for (int g = 0; g < GT; ++g) pp[g] = pairs_set1(packed[g][i]);
#pragma GCC unroll 4
      for (int c = 0; c < C; ++c) {
        const PairInts a = pairs_widen_int8(v + 2 * i * D + c * kChunk);
        const PairInts b = 2 * i + 1 < n ? pairs_widen_int8(v + (2 * i + 1) * D + c * kChunk) : pairs_zero();
        const PairInts lo = pairs_unpacklo(a, b), hi = pairs_unpackhi(a, b);
#pragma GCC unroll 8
        for (int g = 0; g < GT; ++g) {
          lo_sum[g][c] = pairs_dot(first ? pairs_zero() : lo_sum[g][c], lo, pp[g]);
          hi_sum[g][c] = pairs_dot(first ? pairs_zero() : hi_sum[g][c], hi, pp[g]);
        }
      }
    };
    auto pairs = [&](auto prefetching) __attribute__((always_inline)) {
      pair(i0, std::true_type{}, prefetching);  // i0 < i1
      for (int64_t i = i0 + 1; i < i1; ++i) pair(i, std::false_type{}, prefetching);
    };
    if (d != 0 || pf.finished()) pairs(std::false_type{});
    else pairs(std::true_type{});
#pragma GCC unroll 8
    for (int g = 0; g < GT; ++g) {
      const Lanes s = lanes_set1(w_scale[g]);
#pragma GCC unroll 4
      for (int c = 0; c < C; ++c) {
        float* out = acc + g * D + c * kChunk;
        lanes_storeu(out, lanes_fmadd(pairs_to_float(lo_sum[g][c]), s, lanes_loadu(out)));
        lanes_storeu(out + kLanes, lanes_fmadd(pairs_to_float(hi_sum[g][c]), s, lanes_loadu(out + kLanes)));
      }
    }
  }
};
#endif

}  // namespace
}  // namespace minipaged
