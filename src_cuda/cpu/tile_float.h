// The float32 path of a head tile (head_tile.h): cache rows converted to float32 (load16 / load32)
// and multiply-added, for every cache dtype and instruction set.
#pragma once

#include "cpu/lanes.h"
#include "cpu/row_prefetch.h"
#include "cpu/vec.h"

namespace minipaged {
namespace {

// GT query heads of one GQA group, kept in registers while a block streams by: each K/V row is
// loaded once for all GT heads.
template <int GT>
struct FloatTile {
  // The whole query tile in registers (scores_fixed) where it fits beside four tokens' accumulators:
  // a token then costs D/16 loads instead of (1+GT)*D/16. On AVX-512 that is GT * DV <= 16.
  template <int DV>
  static constexpr bool kQueryFits =
      GT * DV <= kVectorRegisters / 2 && GT * DV + (GT <= 2 ? 4 * GT : GT) + 2 <= kVectorRegisters;
  // Otherwise kTokens tokens against up to kHeads query heads at a time (tokens_stepped): their
  // accumulators, the heads' query chunk and one K chunk in registers.
  static constexpr int kTokens = kVectorRegisters >= 16 ? 4 : 2;
  static constexpr int kHeads = kVectorRegisters >= 32 ? 4 : kVectorRegisters >= 8 ? 2 : 1;

  // scores[g * stride + t] = q[g] . k[t] for the n rows of k (q already scaled).
  template <typename T>
  static void scores(const float* q, const T* k, int64_t n, int64_t D, float* scores, int64_t stride,
                     RowPrefetch& pf) {
    if constexpr (kQueryFits<8>) if (D == 128) return scores_fixed<8>(q, k, n, scores, stride, pf);
    if constexpr (kQueryFits<4>) if (D == 64) return scores_fixed<4>(q, k, n, scores, stride, pf);
    if constexpr (kQueryFits<16>) if (D == 256) return scores_fixed<16>(q, k, n, scores, stride, pf);
    int64_t t = 0;
#if defined(MINIPAGED_LANES) && !defined(__AVX512F__)
    if (D % 16 == 0) t = tokens_by_four8(q, k, n, D, scores, stride, pf);
#else
    if (D == 128) t = tokens_stepped<8>(q, k, n, scores, stride, pf);
    if (D == 64) t = tokens_stepped<4>(q, k, n, scores, stride, pf);
    if (D == 256) t = tokens_stepped<16>(q, k, n, scores, stride, pf);
#endif
    const int64_t Dv = D / kW * kW;
    for (; t < n; ++t) {
      pf.upto(t + 1);
      const T* kt = k + t * D;
      f32x16 acc[GT] = {};
      for (int64_t d = 0; d < Dv; d += kW) {
        const f32x16 kv = load16(kt + d);
        for (int g = 0; g < GT; ++g) acc[g] += load(q + g * D + d) * kv;
      }
      store_token(acc, 1.f, scores, stride, t);
      for (int64_t d = Dv; d < D; ++d)  // head_dim not a multiple of 16
        for (int g = 0; g < GT; ++g) scores[g * stride + t] += q[g * D + d] * element_value(kt[d]);
    }
  }
#if defined(MINIPAGED_LANES) && !defined(__AVX512F__)
  // AVX2 (D a multiple of 16): four tokens against two query heads at a time, in 8-float vectors
  // (8 accumulators, 4 query vectors and a K chunk in its 16 registers: 8 FMA chains cover the FMA
  // latency), each 16-element K chunk widened once for both heads, the eight sums reduced together
  // by horizontal adds. Larger tiles take their heads two at a time, the four rows then in L1.
  // Returns the tokens done (a multiple of four).
  template <typename T>
  static int64_t tokens_by_four8(const float* q, const T* k, int64_t n, int64_t D, float* scores, int64_t stride,
                                 RowPrefetch& pf) {
    int64_t t = 0;
    for (; t + 4 <= n; t += 4) {
      pf.upto(t + 4);
      for (int g = 0; g + 1 < GT; g += 2) four_tokens8<2>(q + g * D, k + t * D, D, scores + g * stride + t, stride);
      if constexpr (GT % 2 == 1) four_tokens8<1>(q + (GT - 1) * D, k + t * D, D, scores + (GT - 1) * stride + t, stride);
    }
    return t;
  }
  template <int H, typename T>
  __attribute__((always_inline)) static void four_tokens8(const float* q, const T* k, int64_t D, float* scores,
                                                          int64_t stride) {
    Lanes a[4][H];
    for (int i = 0; i < 4; ++i)
      for (int h = 0; h < H; ++h) a[i][h] = lanes_zero();
    for (int64_t d = 0; d < D; d += 16) {
      Lanes q0[H], q1[H];
      for (int h = 0; h < H; ++h) q0[h] = lanes_loadu(q + h * D + d), q1[h] = lanes_loadu(q + h * D + d + 8);
      for (int i = 0; i < 4; ++i) {
        Lanes k0, k1;
        lanes_load16(k + i * D + d, k0, k1);
        for (int h = 0; h < H; ++h) a[i][h] = lanes_fmadd(q1[h], k1, lanes_fmadd(q0[h], k0, a[i][h]));
      }
    }
    // hadd twice leaves, per 128-bit half, the four tokens' partial sums of one head.
    for (int h = 0; h < H; ++h) {
      const __m256 s = _mm256_hadd_ps(_mm256_hadd_ps(a[0][h], a[1][h]), _mm256_hadd_ps(a[2][h], a[3][h]));
      _mm_storeu_ps(scores + h * stride, _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1)));
    }
  }
#endif
  // Tiles too big to keep the query in registers: kTokens tokens (rows of k) against H <= kHeads
  // query heads at a time, each 16-element chunk of the H query rows loaded once for all the tokens
  // (kTokens + H loads for kTokens x H multiply-adds, as many independent chains, one reduction per
  // head and token). Returns the tokens done (a multiple of kTokens). DV = head_dim / 16, fixed so
  // that the accumulators stay in registers.
  template <int DV, typename T>
  static int64_t tokens_stepped(const float* q, const T* k, int64_t n, float* scores, int64_t stride,
                                RowPrefetch& pf) {
    constexpr int64_t D = DV * kW;
    int64_t t = 0;
    for (; t + kTokens <= n; t += kTokens) {
      pf.upto(t + kTokens);
      head_groups<DV, 0>(q, k + t * D, scores + t, stride);
    }
    return t;
  }
  template <int DV, int G0, typename T>
  __attribute__((always_inline)) static void head_groups(const float* q, const T* k, float* scores, int64_t stride) {
    constexpr int H = GT - G0 < kHeads ? GT - G0 : kHeads;
    some_tokens<DV, H>(q + G0 * DV * kW, k, scores + G0 * stride, stride);
    if constexpr (G0 + H < GT) head_groups<DV, G0 + H>(q, k, scores, stride);
  }
  template <int DV, int H, typename T>
  static void some_tokens(const float* q, const T* k, float* scores, int64_t stride) {
    constexpr int64_t D = DV * kW;
    f32x16 a[kTokens][H];
    auto chunk = [&](int c, auto first) __attribute__((always_inline)) {
      f32x16 qv[H];
      for (int h = 0; h < H; ++h) qv[h] = load(q + h * D + c * kW);
      for (int i = 0; i < kTokens; ++i) {
        const f32x16 kv = load16(k + i * D + c * kW);
        for (int h = 0; h < H; ++h) a[i][h] = first ? qv[h] * kv : a[i][h] + qv[h] * kv;
      }
    };
    chunk(0, std::true_type{});  // sets the accumulators: no zeroing, which GCC does in memory
    for (int c = 1; c < DV; ++c) chunk(c, std::false_type{});
    if constexpr (kTokens == 4) {
      for (int h = 0; h < H; ++h) store_4_tokens(a[0][h], a[1][h], a[2][h], a[3][h], 1.f, scores + h * stride);
    } else {  // two tokens: reduced two heads at a time
      for (int h = 0; h < H; h += 2) {
        const f32x16 zero{};
        const f32x4 s = hsum4(a[0][h], a[1][h], h + 1 < H ? a[0][h + 1] : zero, h + 1 < H ? a[1][h + 1] : zero);
        scores[h * stride] = s[0];
        scores[h * stride + 1] = s[1];
        if (h + 1 < H) {
          scores[(h + 1) * stride] = s[2];
          scores[(h + 1) * stride + 1] = s[3];
        }
      }
    }
  }
  template <int DV, typename T>  // DV = head_dim / 16
  static void scores_fixed(const float* q, const T* k, int64_t n, float* scores, int64_t stride, RowPrefetch& pf) {
    constexpr int64_t D = DV * kW;
    f32x16 qv[GT][DV];
    for (int g = 0; g < GT; ++g)
      for (int c = 0; c < DV; ++c) qv[g][c] = load(q + g * D + c * kW);
    int64_t t = 0;
    if constexpr (GT <= 2) {  // four tokens at a time: independent FMA chains, one reduction
      for (; t + 4 <= n; t += 4) {
        pf.upto(t + 4);
        f32x16 a[4][GT] = {};
        for (int c = 0; c < DV; c += 2)  // DV is even (head_dim 64, 128, 256)
          for (int i = 0; i < 4; ++i) {
            f32x16 kv0, kv1;
            load32(k + (t + i) * D + c * kW, kv0, kv1);
            for (int g = 0; g < GT; ++g) a[i][g] += qv[g][c] * kv0;
            for (int g = 0; g < GT; ++g) a[i][g] += qv[g][c + 1] * kv1;
          }
        for (int g = 0; g < GT; ++g) store_4_tokens(a[0][g], a[1][g], a[2][g], a[3][g], 1.f, scores + g * stride + t);
      }
    }
    for (; t < n; ++t) {
      pf.upto(t + 1);
      f32x16 a0[GT] = {};
      for (int c = 0; c < DV; ++c)
        for (int g = 0; g < GT; ++g) a0[g] += qv[g][c] * load16(k + t * D + c * kW);
      store_token(a0, 1.f, scores, stride, t);
    }
  }
  // acc[g] += sum_t p[g * stride + t] * v[t] over the n rows of v. D is walked in panels of P
  // vectors so the GT x P accumulators stay in registers for the whole block.
  template <typename T>
  static void accumulate(const float* p, int64_t stride, const T* v, int64_t n, int64_t D, float* acc,
                         RowPrefetch& pf) {
#if defined(MINIPAGED_LANES) && !defined(__AVX512F__)
    // AVX2: GT x P accumulators of 16 floats would not fit its 16 ymm registers, and GCC then
    // lowers the 64-byte vector arithmetic through the stack, 16 bytes at a time (most of a decode
    // step, in perf). Here in 8-float vectors: GT x P accumulators, P V chunks and a broadcast.
    constexpr int P = (GT + 1) * 4 + 1 <= 16 ? 4 : 2;  // 8-float chunks, even: V is read 16 at a time
    // Windows of about 2 KiB of V rows, at least 8 tokens (measured against 16: float32 and
    // bfloat16 a little faster with 8, fp8 slower).
    const int64_t window = std::max<int64_t>(8, 2048 / (D * static_cast<int64_t>(sizeof(T))));
    int64_t d = 0;
    for (int64_t t0 = 0; t0 < n; t0 += window) {
      const int64_t t1 = std::min(n, t0 + window);
      d = 0;
      for (; d + P * 8 <= D; d += P * 8) panel8<P>(p, stride, v, t0, t1, D, acc, d, pf);
      if constexpr (P > 2) for (; d + 16 <= D; d += 16) panel8<2>(p, stride, v, t0, t1, D, acc, d, pf);
    }
#else
    constexpr int P = GT * 8 <= 16 ? 8 : GT * 4 <= 16 ? 4 : 2;
    int64_t d = 0;
    for (; d + P * kW <= D; d += P * kW) panel<P>(p, stride, v, n, D, acc, d, pf);
    if constexpr (P > 4) for (; d + 4 * kW <= D; d += 4 * kW) panel<4>(p, stride, v, n, D, acc, d, pf);
    if constexpr (P > 2) for (; d + 2 * kW <= D; d += 2 * kW) panel<2>(p, stride, v, n, D, acc, d, pf);
    for (; d + kW <= D; d += kW) panel<1>(p, stride, v, n, D, acc, d, pf);
#endif
    pf.upto(pf.rows);
    for (; d < D; ++d)
      for (int64_t t = 0; t < n; ++t)
        for (int g = 0; g < GT; ++g) acc[g * D + d] += p[g * stride + t] * element_value(v[t * D + d]);
  }
#if defined(MINIPAGED_LANES) && !defined(__AVX512F__)
  template <int P, typename T>
  static void panel8(const float* p, int64_t stride, const T* v, int64_t t0, int64_t t1, int64_t D, float* acc,
                     int64_t d, RowPrefetch& pf) {
    Lanes a[GT][P];
    for (int g = 0; g < GT; ++g)
      for (int c = 0; c < P; ++c) a[g][c] = lanes_loadu(acc + g * D + d + c * 8);
    // Only the first panel of a block drives the prefetch stream (the rest re-read rows it brought
    // in): its bookkeeping per token cost as many instructions as the panel's arithmetic.
    auto tokens = [&](auto prefetching) __attribute__((always_inline)) {
      for (int64_t t = t0; t < t1; ++t) {
        if constexpr (prefetching) pf.upto(t + 1);
        Lanes vv[P];
        for (int c = 0; c < P; c += 2) lanes_load16(v + t * D + d + c * 8, vv[c], vv[c + 1]);
        for (int g = 0; g < GT; ++g) {
          const Lanes pg = lanes_set1(p[g * stride + t]);
          for (int c = 0; c < P; ++c) a[g][c] = lanes_fmadd(pg, vv[c], a[g][c]);
        }
      }
    };
    if (d != 0 || pf.finished()) tokens(std::false_type{});
    else tokens(std::true_type{});
    for (int g = 0; g < GT; ++g)
      for (int c = 0; c < P; ++c) lanes_storeu(acc + g * D + d + c * 8, a[g][c]);
  }
#endif
  template <int P, typename T>
  static void panel(const float* p, int64_t stride, const T* v, int64_t n, int64_t D, float* acc, int64_t d,
                    RowPrefetch& pf) {
    f32x16 a[GT][P];
#pragma GCC unroll 16
    for (int g = 0; g < GT; ++g)
#pragma GCC unroll 16
      for (int c = 0; c < P; ++c) a[g][c] = load(acc + g * D + d + c * kW);
    for (int64_t t = 0; t < n; ++t) {
      pf.upto(t + 1);
      f32x16 vv[P];
#pragma GCC unroll 8
      for (int c = 0; c + 1 < P; c += 2) load32(v + t * D + d + c * kW, vv[c], vv[c + 1]);
      if constexpr (P % 2 == 1) vv[P - 1] = load16(v + t * D + d + (P - 1) * kW);
#pragma GCC unroll 16
      for (int g = 0; g < GT; ++g) {
        const float pg = p[g * stride + t];
#pragma GCC unroll 16
        for (int c = 0; c < P; ++c) a[g][c] += pg * vv[c];
      }
    }
#pragma GCC unroll 16
    for (int g = 0; g < GT; ++g)
#pragma GCC unroll 16
      for (int c = 0; c < P; ++c) store(acc + g * D + d + c * kW, a[g][c]);
  }
};

}  // namespace
}  // namespace minipaged
