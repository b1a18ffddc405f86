// The AVX512-VNNI path of a head tile (head_tile.h): int8 caches with a 16-bit query, Q.K and P.V
// as 16-bit integer pair dot products (vpdpwssd).
#pragma once

#include "cpu/row_prefetch.h"
#include "cpu/vec.h"

namespace minipaged {
namespace {

#if defined(__AVX512VNNI__)
// The query of an int8 work item for HeadTile::scores_int8: each head's row rounded to int16
// against its largest element (q16 = round(q / q_scale), |q16| <= 32767: an error below 2^-16 of
// that element, less than the float16 / bfloat16 rounding the query came with). A row with a NaN or
// infinity gets a NaN scale, so its scores are NaN as in the float kernels. D a multiple of 16.
inline void quantize_query(const float* q, int64_t num_heads, int64_t D, int16_t* q16, float* q_scale) {
  for (int64_t h = 0; h < num_heads; ++h) {
    const float* row = q + h * D;
    __m512 top = _mm512_setzero_ps();
    for (int64_t d = 0; d < D; d += 16) top = _mm512_max_ps(top, _mm512_abs_ps(_mm512_loadu_ps(row + d)));
    float largest = _mm512_reduce_max_ps(top);  // vmaxps passes a NaN through from its second operand only
    for (int64_t d = 0; d < D; ++d) largest = std::isfinite(row[d]) ? largest : std::numeric_limits<float>::quiet_NaN();
    q_scale[h] = largest > 0.f || std::isnan(largest) ? largest * (1.f / 32767.f) : 1.f;
    const __m512 inv = _mm512_set1_ps(largest > 0.f ? 32767.f / largest : 0.f);
    for (int64_t d = 0; d < D; d += 16)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(q16 + h * D + d),
                          _mm512_cvtsepi32_epi16(_mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(row + d), inv))));
  }
}

template <int GT>
struct Int8Tile {
  // int8 Q.K with the 16-bit integer pair dot product (vpdpwssd: 32 products summed exactly into
  // 16 int32 lanes, issued as fast as a 16-lane float multiply-add on the Xeon measured): the query
  // rounded to int16 per head (quantize_query), each K row widened from int8 in one instruction
  // instead of the two (widen, convert) that float multiply-adds need. scores[g][t] = q_scale[g] *
  // k_scales[t] * (q16[g] . k[t]). D a multiple of 32, at most 512 (no int32 overflow).
  static void scores_int8(const int16_t* q16, const float* q_scale, const int8_t* k, const float* k_scales, int64_t n,
                          int64_t D, float* scores, int64_t stride, RowPrefetch& pf) {
    int64_t t = 0;
    if (D == 128) t = tokens_by_four_int8<4>(q16, q_scale, k, k_scales, n, scores, stride, pf);
    if (D == 64) t = tokens_by_four_int8<2>(q16, q_scale, k, k_scales, n, scores, stride, pf);
    if (D == 256) t = tokens_by_four_int8<8>(q16, q_scale, k, k_scales, n, scores, stride, pf);
    for (; t < n; ++t) {
      pf.upto(t + 1);
      __m512i a[GT];
      for (int g = 0; g < GT; ++g) a[g] = _mm512_setzero_si512();
      for (int64_t d = 0; d < D; d += 32) {
        const __m512i kv = widen_int8(k + t * D + d);
        for (int g = 0; g < GT; ++g) a[g] = _mm512_dpwssd_epi32(a[g], kv, _mm512_loadu_si512(q16 + g * D + d));
      }
      f32x16 acc[GT];
      for (int g = 0; g < GT; ++g) acc[g] = as_float(a[g]) * (q_scale[g] * k_scales[t]);
      store_token(acc, 1.f, scores, stride, t);
    }
  }
  static __m512i widen_int8(const int8_t* p) {
    return _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  static f32x16 as_float(__m512i sums) {
    const __m512 f = _mm512_cvtepi32_ps(sums);
    return reinterpret_cast<const f32x16&>(f);
  }
  template <int DC>  // DC = head_dim / 32
  static int64_t tokens_by_four_int8(const int16_t* q16, const float* q_scale, const int8_t* k, const float* k_scales,
                                     int64_t n, float* scores, int64_t stride, RowPrefetch& pf) {
    int64_t t = 0;
    for (; t + 4 <= n; t += 4) {
      pf.upto(t + 4);
      four_tokens_int8<DC, (GT < 4 ? GT : 4)>(q16, q_scale, k + t * DC * 32, k_scales + t, scores + t, stride);
      if constexpr (GT > 4)
        four_tokens_int8<DC, GT - 4>(q16 + 4 * DC * 32, q_scale + 4, k + t * DC * 32, k_scales + t,
                                     scores + 4 * stride + t, stride);
    }
    return t;
  }
  // Four tokens (rows of k) against H <= 4 query heads, each 32-element chunk of the query loaded
  // once for the four.
  template <int DC, int H>
  static void four_tokens_int8(const int16_t* q16, const float* q_scale, const int8_t* k, const float* k_scales,
                               float* scores, int64_t stride) {
    constexpr int64_t D = DC * 32;
    __m512i a[4][H];
    auto chunk = [&](int c, auto first) __attribute__((always_inline)) {
      __m512i qv[H];
      for (int h = 0; h < H; ++h) qv[h] = _mm512_loadu_si512(q16 + h * D + c * 32);
      for (int i = 0; i < 4; ++i) {
        const __m512i kv = widen_int8(k + i * D + c * 32);
        for (int h = 0; h < H; ++h) a[i][h] = _mm512_dpwssd_epi32(first ? _mm512_setzero_si512() : a[i][h], kv, qv[h]);
      }
    };
    chunk(0, std::true_type{});
    for (int c = 1; c < DC; ++c) chunk(c, std::false_type{});
    f32x4 token_scales;
    std::memcpy(&token_scales, k_scales, sizeof(token_scales));
    using i32x16 = int32_t __attribute__((vector_size(64)));
    auto as_i32 = [](__m512i v) { return reinterpret_cast<const i32x16&>(v); };
    for (int h = 0; h < H; ++h) {
      const auto sums = hsum4(as_i32(a[0][h]), as_i32(a[1][h]), as_i32(a[2][h]), as_i32(a[3][h]));  // exact
      const f32x4 s = __builtin_convertvector(sums, f32x4) * (token_scales * q_scale[h]);
      std::memcpy(scores + h * stride, &s, sizeof(s));
    }
  }
  // acc[g] += sum_t p[g][t] * v_scales[t] * v[t] for int8 rows, two tokens per vpdpwssd as in
  // accumulate_bf16 (rows t and t+1 interleaved, the accumulators in unpack order, see
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
      __m512 top = _mm512_setzero_ps();
      for (int64_t t = 0; t < n; t += 16) {
        const __mmask16 live = first_lanes(n - t);
        top = _mm512_max_ps(top, _mm512_mul_ps(_mm512_maskz_loadu_ps(live, pg + t), _mm512_maskz_loadu_ps(live, v_scales + t)));
      }
      const float largest = _mm512_reduce_max_ps(top);
      w_scale[g] = largest > 0.f ? largest * (1.f / 32767.f) : 1.f;
      const __m512 inv = _mm512_set1_ps(32767.f / (largest > 0.f ? largest : 32767.f));
      for (int64_t t = 0; t < n; t += 16) {
        const __mmask16 live = first_lanes(n - t);
        const __m512 w = _mm512_mul_ps(_mm512_maskz_loadu_ps(live, pg + t), _mm512_maskz_loadu_ps(live, v_scales + t));
        const __m256i w16 = _mm512_cvtepi32_epi16(_mm512_cvtps_epi32(_mm512_mul_ps(w, inv)));
        std::memcpy(&packed[g][t / 2], &w16, sizeof(w16));
      }
    }
    constexpr int C = 2 * GT * 4 <= 20 ? 4 : 2 * GT * 2 <= 20 ? 2 : 1;
    int64_t d = 0;
    for (; d + C * 32 <= D; d += C * 32) accumulate_int8_panel<C>(packed, w_scale, v, n, D, acc + d, d, pf);
    for (; d < D; d += 32) accumulate_int8_panel<1>(packed, w_scale, v, n, D, acc + d, d, pf);
    pf.upto(pf.rows);
  }
  template <int C>
  static void accumulate_int8_panel(const uint32_t (*packed)[kMaxPairs], const float* w_scale, const int8_t* v, int64_t n,
                                    int64_t D, float* acc, int64_t d, RowPrefetch& pf) {
    __m512i lo_sum[GT][C], hi_sum[GT][C];
    v += d;
    auto pair = [&](int64_t i, auto first) __attribute__((always_inline)) {
      pf.upto(2 * i + 2);
      __m512i pp[GT];
#pragma GCC unroll 8
      for (int g = 0; g < GT; ++g) pp[g] = _mm512_set1_epi32(static_cast<int>(packed[g][i]));
#pragma GCC unroll 4
      for (int c = 0; c < C; ++c) {
        const __m512i a = widen_int8(v + 2 * i * D + c * 32);
        const __m512i b = 2 * i + 1 < n ? widen_int8(v + (2 * i + 1) * D + c * 32) : _mm512_setzero_si512();
        const __m512i lo = _mm512_unpacklo_epi16(a, b), hi = _mm512_unpackhi_epi16(a, b);
#pragma GCC unroll 8
        for (int g = 0; g < GT; ++g) {
          lo_sum[g][c] = _mm512_dpwssd_epi32(first ? _mm512_setzero_si512() : lo_sum[g][c], lo, pp[g]);
          hi_sum[g][c] = _mm512_dpwssd_epi32(first ? _mm512_setzero_si512() : hi_sum[g][c], hi, pp[g]);
        }
      }
    };
    pair(0, std::true_type{});  // n >= 1
    for (int64_t i = 1; 2 * i < n; ++i) pair(i, std::false_type{});
#pragma GCC unroll 8
    for (int g = 0; g < GT; ++g) {
      const __m512 s = _mm512_set1_ps(w_scale[g]);
#pragma GCC unroll 4
      for (int c = 0; c < C; ++c) {
        float* out = acc + g * D + c * 32;
        _mm512_storeu_ps(out, _mm512_fmadd_ps(_mm512_cvtepi32_ps(lo_sum[g][c]), s, _mm512_loadu_ps(out)));
        _mm512_storeu_ps(out + 16, _mm512_fmadd_ps(_mm512_cvtepi32_ps(hi_sum[g][c]), s, _mm512_loadu_ps(out + 16)));
      }
    }
  }
};
#endif

}  // namespace
}  // namespace minipaged
