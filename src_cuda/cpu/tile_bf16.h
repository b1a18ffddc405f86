// The AVX512-BF16 path of a head tile (head_tile.h): bfloat16 Q.K and P.V with the pair dot
// product vdpbf16ps.
#pragma once

#include "cpu/bf16_rows.h"
#include "cpu/row_prefetch.h"
#include "cpu/vec.h"

namespace minipaged {
namespace {

#if defined(__AVX512BF16__)
template <int GT>
struct Bf16Tile {
  // bfloat16 Q.K with the hardware's bf16 pair dot product (products exact, float32 sums): the
  // query stays in bfloat16 (it is bfloat16 already) and the scale is applied to the scores.
  template <typename T>
  static void scores_bf16(const c10::BFloat16* q, float scale, const T* k, int64_t n, int64_t D,
                          float* scores, int64_t stride, RowPrefetch& pf) {
    auto as_f32x16 = [](__m512 v) { return reinterpret_cast<const f32x16&>(v); };
    int64_t t = 0;
    if constexpr (GT > 2) {
      if (D == 128) t = tokens_by_four_bf16<4>(q, scale, k, n, scores, stride, pf);
      if (D == 64) t = tokens_by_four_bf16<2>(q, scale, k, n, scores, stride, pf);
      if (D == 256) t = tokens_by_four_bf16<8>(q, scale, k, n, scores, stride, pf);
    }
    if constexpr (GT <= 2)
      if (D == 128) {  // query tile in registers, four tokens at a time as in scores_fixed
        __m512bh qv[GT][4];
        for (int g = 0; g < GT; ++g)
          for (int c = 0; c < 4; ++c) qv[g][c] = (__m512bh)_mm512_loadu_si512(q + g * D + c * 32);
        for (; t + 4 <= n; t += 4) {
          pf.upto(t + 4);
          __m512 a[4][GT];
          for (int i = 0; i < 4; ++i)
            for (int g = 0; g < GT; ++g) a[i][g] = _mm512_setzero_ps();
          for (int c = 0; c < 4; c += 2)
            for (int i = 0; i < 4; ++i) {
              __m512i k0, k1;
              bf16x64(k + (t + i) * D + c * 32, k0, k1);
              for (int g = 0; g < GT; ++g)
                a[i][g] = _mm512_dpbf16_ps(_mm512_dpbf16_ps(a[i][g], qv[g][c], (__m512bh)k0), qv[g][c + 1], (__m512bh)k1);
            }
          for (int g = 0; g < GT; ++g)
            store_4_tokens(as_f32x16(a[0][g]), as_f32x16(a[1][g]), as_f32x16(a[2][g]), as_f32x16(a[3][g]), scale,
                           scores + g * stride + t);
        }
      }
    for (; t < n; ++t) {
      pf.upto(t + 1);
      __m512 a[GT];
      for (int g = 0; g < GT; ++g) a[g] = _mm512_setzero_ps();
      int64_t d = 0;
      for (; d + 64 <= D; d += 64) {
        __m512i k0, k1;
        bf16x64(k + t * D + d, k0, k1);
        for (int g = 0; g < GT; ++g)
          a[g] = _mm512_dpbf16_ps(_mm512_dpbf16_ps(a[g], (__m512bh)_mm512_loadu_si512(q + g * D + d), (__m512bh)k0),
                                  (__m512bh)_mm512_loadu_si512(q + g * D + d + 32), (__m512bh)k1);
      }
      if (d < D) {
        const __m512bh kv = (__m512bh)bf16x32(k + t * D + d);
        for (int g = 0; g < GT; ++g)
          a[g] = _mm512_dpbf16_ps(a[g], (__m512bh)_mm512_loadu_si512(q + g * D + d), kv);
      }
      f32x16 acc[GT];
      for (int g = 0; g < GT; ++g) acc[g] = as_f32x16(a[g]);
      store_token(acc, scale, scores, stride, t);
    }
  }
  // tokens_by_four with the pair dot product. DC = head_dim / 32.
  template <int DC, typename T>
  static int64_t tokens_by_four_bf16(const c10::BFloat16* q, float scale, const T* k, int64_t n,
                                     float* scores, int64_t stride, RowPrefetch& pf) {
    constexpr int64_t D = DC * 32;
    int64_t t = 0;
    for (; t + 4 <= n; t += 4) {
      pf.upto(t + 4);
      four_tokens_bf16<DC, (GT < 4 ? GT : 4)>(q, scale, k + t * D, scores + t, stride);
      if constexpr (GT > 4) four_tokens_bf16<DC, GT - 4>(q + 4 * D, scale, k + t * D, scores + 4 * stride + t, stride);
    }
    return t;
  }
  template <int DC, int H, typename T>
  static void four_tokens_bf16(const c10::BFloat16* q, float scale, const T* k, float* scores,
                               int64_t stride) {
    constexpr int64_t D = DC * 32;
    __m512 a[4][H];
    static_assert(DC % 2 == 0, "head_dim a multiple of 64 (bf16x64)");
    auto chunks = [&](int c, auto first) __attribute__((always_inline)) {  // c and c + 1
      __m512bh q0[H], q1[H];
      for (int h = 0; h < H; ++h)
        q0[h] = (__m512bh)_mm512_loadu_si512(q + h * D + c * 32), q1[h] = (__m512bh)_mm512_loadu_si512(q + h * D + c * 32 + 32);
      for (int i = 0; i < 4; ++i) {
        __m512i k0, k1;
        bf16x64(k + i * D + c * 32, k0, k1);
        for (int h = 0; h < H; ++h)
          a[i][h] = _mm512_dpbf16_ps(_mm512_dpbf16_ps(first ? _mm512_setzero_ps() : a[i][h], q0[h], (__m512bh)k0), q1[h],
                                     (__m512bh)k1);
      }
    };
    chunks(0, std::true_type{});
    for (int c = 2; c < DC; c += 2) chunks(c, std::false_type{});
    auto as_f32x16 = [](__m512 v) { return reinterpret_cast<const f32x16&>(v); };
    for (int h = 0; h < H; ++h)
      store_4_tokens(as_f32x16(a[0][h]), as_f32x16(a[1][h]), as_f32x16(a[2][h]), as_f32x16(a[3][h]), scale,
                     scores + h * stride);
  }
  // acc[g] += sum_t p[g][t] * v[t] with the same pair dot product, two tokens per instruction:
  // rows t and t+1 are interleaved (unpacklo/hi), so the accumulators hold each 32-element chunk
  // in "unpack order" (see from_unpack_order). The probabilities are rounded to bfloat16 for this
  // product, as FlashAttention does for P.V; the softmax itself stays float32. n <= 256.
  template <typename T>
  static void accumulate_bf16(const float* p, int64_t stride, const T* v, int64_t n, int64_t D,
                              float* acc, RowPrefetch& pf) {
    // (p[t], p[t+1]) as a bfloat16 pair is p rounded to bfloat16, read two at a time; a zero
    // pads an odd n.
    alignas(64) uint32_t packed[GT][kMaxPairs];
    for (int g = 0; g < GT; ++g)
      for (int64_t t = 0; t < n; t += 16) {
        const __mmask16 live = first_lanes(n - t);
        const __m256bh b = _mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(live, p + g * stride + t));
        std::memcpy(&packed[g][t / 2], &b, sizeof(b));
      }
    // Panels of C 32-element chunks: the 2 x GT x C accumulators stay in registers while V is
    // walked row pair by row pair, and there are enough of them to hide the dot product's latency.
    constexpr int C = 2 * GT * 4 <= 24 ? 4 : 2 * GT * 2 <= 24 ? 2 : 1;
    int64_t d = 0;
#if defined(MINIPAGED_FP8_LOOKUP)
    if constexpr (kFp8<T> && C % 2 == 0) {
      for (; d + C * 32 <= D; d += C * 32) accumulate_fp8_panel<C / 2>(packed, v, n, D, acc + d, d, pf);
    }
#endif
    for (; d + C * 32 <= D; d += C * 32) accumulate_bf16_panel<C>(packed, v, n, D, acc + d, d, pf);
    for (; d < D; d += 32) accumulate_bf16_panel<1>(packed, v, n, D, acc + d, d, pf);
    pf.upto(pf.rows);
  }
  // Every head's weights of token pair i, broadcast: (p[2i], p[2i + 1]) as a bfloat16 pair.
  __attribute__((always_inline)) static void pair_weights(const uint32_t (*packed)[kMaxPairs], int64_t i, __m512bh (&pp)[GT]) {
#pragma GCC unroll 8
    for (int g = 0; g < GT; ++g) pp[g] = (__m512bh)_mm512_set1_epi32(static_cast<int>(packed[g][i]));
  }
#if defined(MINIPAGED_FP8_LOOKUP)
  // accumulate_bf16_panel for fp8 rows, 64 columns at a time per group: rows t and t+1 interleaved
  // byte by byte first (two unpacks for 64 columns), then each byte pair looked up, so the lookups'
  // own interleave yields the bfloat16 pairs: 12 instructions per row pair and 64 columns instead
  // of 16. The block's sums, started from zero, come out in another order and are added to acc in
  // unpack order (add_in_unpack_order).
  template <int G, typename T>
  static void accumulate_fp8_panel(const uint32_t (*packed)[kMaxPairs], const T* v, int64_t n, int64_t D, float* acc,
                                   int64_t d, RowPrefetch& pf) {
    const Fp8ByteTables& t = kFp8Bytes<T>;
    const __m512i lo0 = _mm512_load_si512(t.lo), lo1 = _mm512_load_si512(t.lo + 64);
    const __m512i hi0 = _mm512_load_si512(t.hi), hi1 = _mm512_load_si512(t.hi + 64);
    const __m512i sign = _mm512_set1_epi8(static_cast<char>(0x80));
    __m512 sums[GT][G][4];
#pragma GCC unroll 8
    for (int g = 0; g < GT; ++g)
#pragma GCC unroll 4
      for (int c = 0; c < G; ++c)
        for (int k = 0; k < 4; ++k) sums[g][c][k] = _mm512_setzero_ps();
    v += d;
    for (int64_t i = 0; 2 * i < n; ++i) {
      pf.upto(2 * i + 2);
      __m512bh pp[GT];
      pair_weights(packed, i, pp);
      const bool pair = 2 * i + 1 < n;
#pragma GCC unroll 4
      for (int c = 0; c < G; ++c) {
        const __m512i a = _mm512_loadu_si512(v + 2 * i * D + c * 64);
        const __m512i b = pair ? _mm512_loadu_si512(v + (2 * i + 1) * D + c * 64) : _mm512_setzero_si512();
        const __m512i halves[2] = {_mm512_unpacklo_epi8(a, b), _mm512_unpackhi_epi8(a, b)};
#pragma GCC unroll 2
        for (int h = 0; h < 2; ++h) {
          const __m512i lo = _mm512_permutex2var_epi8(lo0, halves[h], lo1);
          const __m512i hi = _mm512_ternarylogic_epi32(_mm512_permutex2var_epi8(hi0, halves[h], hi1), halves[h], sign, 0xf8);
          const __m512bh p0 = (__m512bh)_mm512_unpacklo_epi8(lo, hi), p1 = (__m512bh)_mm512_unpackhi_epi8(lo, hi);
#pragma GCC unroll 8
          for (int g = 0; g < GT; ++g) {
            sums[g][c][2 * h] = _mm512_dpbf16_ps(sums[g][c][2 * h], p0, pp[g]);
            sums[g][c][2 * h + 1] = _mm512_dpbf16_ps(sums[g][c][2 * h + 1], p1, pp[g]);
          }
        }
      }
    }
#pragma GCC unroll 8
    for (int g = 0; g < GT; ++g)
#pragma GCC unroll 4
      for (int c = 0; c < G; ++c) add_in_unpack_order(sums[g][c], acc + g * D + c * 64);
  }
#endif
  // acc[g][0, 32 C) (row stride D) += the pairs' products over v's columns [d, d + 32 C). The first
  // panel also trickles out the prefetch (pf), a row pair at a time.
  template <int C, typename T>
  static void accumulate_bf16_panel(const uint32_t (*packed)[kMaxPairs], const T* v, int64_t n, int64_t D,
                                    float* acc, int64_t d, RowPrefetch& pf) {
    __m512 lo_acc[GT][C], hi_acc[GT][C];
#pragma GCC unroll 8
    for (int g = 0; g < GT; ++g)
#pragma GCC unroll 4
      for (int c = 0; c < C; ++c)
        lo_acc[g][c] = _mm512_loadu_ps(acc + g * D + c * 32), hi_acc[g][c] = _mm512_loadu_ps(acc + g * D + c * 32 + 16);
    v += d;
    for (int64_t i = 0; 2 * i < n; ++i) {
      pf.upto(2 * i + 2);
      __m512bh pp[GT];
      pair_weights(packed, i, pp);
      auto add = [&](int c, __m512i a, __m512i b) __attribute__((always_inline)) {
        const __m512bh lo = (__m512bh)_mm512_unpacklo_epi16(a, b), hi = (__m512bh)_mm512_unpackhi_epi16(a, b);
#pragma GCC unroll 8
        for (int g = 0; g < GT; ++g) {
          lo_acc[g][c] = _mm512_dpbf16_ps(lo_acc[g][c], lo, pp[g]);
          hi_acc[g][c] = _mm512_dpbf16_ps(hi_acc[g][c], hi, pp[g]);
        }
      };
      const bool pair = 2 * i + 1 < n;
      if constexpr (C % 2 == 0) {
#pragma GCC unroll 4
        for (int c = 0; c < C; c += 2) {
          __m512i a0, a1, b0 = _mm512_setzero_si512(), b1 = _mm512_setzero_si512();
          bf16x64(v + 2 * i * D + c * 32, a0, a1);
          if (pair) bf16x64(v + (2 * i + 1) * D + c * 32, b0, b1);
          add(c, a0, b0), add(c + 1, a1, b1);
        }
      } else {
        for (int c = 0; c < C; ++c)
          add(c, bf16x32(v + 2 * i * D + c * 32), pair ? bf16x32(v + (2 * i + 1) * D + c * 32) : _mm512_setzero_si512());
      }
    }
#pragma GCC unroll 8
    for (int g = 0; g < GT; ++g)
#pragma GCC unroll 4
      for (int c = 0; c < C; ++c)
        _mm512_storeu_ps(acc + g * D + c * 32, lo_acc[g][c]), _mm512_storeu_ps(acc + g * D + c * 32 + 16, hi_acc[g][c]);
  }
};
#endif

}  // namespace
}  // namespace minipaged
