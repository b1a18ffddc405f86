// The float32 path of a head tile (head_tile.h): cache rows converted to float32 (load16 / load32)
// and multiply-added, for every cache dtype and instruction set.
#pragma once

#include "cpu/row_prefetch.h"
#include "cpu/vec.h"

namespace minipaged {
namespace {

// GT query heads of one GQA group, kept in registers while a block streams by: each K/V row is
// loaded once for all GT heads.
template <int GT>
struct FloatTile {
  // scores[g * stride + t] = q[g] . k[t] for the n rows of k (q already scaled).
  template <typename T>
  static void scores(const float* q, const T* k, int64_t n, int64_t D, float* scores, int64_t stride,
                     RowPrefetch& pf) {
    // With the whole query tile in registers, a token costs D/16 loads instead of (1+GT)*D/16.
    if constexpr (GT * 8 <= 16) if (D == 128) return scores_fixed<8>(q, k, n, scores, stride, pf);
    if constexpr (GT * 4 <= 16) if (D == 64) return scores_fixed<4>(q, k, n, scores, stride, pf);
    if constexpr (GT * 16 <= 16) if (D == 256) return scores_fixed<16>(q, k, n, scores, stride, pf);
    int64_t t = 0;
    if (D == 128) t = tokens_by_four<8>(q, k, n, scores, stride, pf);
    if (D == 64) t = tokens_by_four<4>(q, k, n, scores, stride, pf);
    if (D == 256) t = tokens_by_four<16>(q, k, n, scores, stride, pf);
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
  // Tiles too big to keep the query in registers: four tokens (rows of k) against H <= 4 query
  // heads at a time, each 16-element chunk of the H query rows loaded once for all four tokens
  // (4 + H loads for 4 x H multiply-adds, 4 x H independent chains, one reduction per head).
  // Returns the tokens done (a multiple of four). DV = head_dim / 16, fixed so that the 4 x H
  // accumulators stay in registers.
  template <int DV, typename T>
  static int64_t tokens_by_four(const float* q, const T* k, int64_t n, float* scores, int64_t stride,
                                RowPrefetch& pf) {
    constexpr int64_t D = DV * kW;
    int64_t t = 0;
    for (; t + 4 <= n; t += 4) {
      pf.upto(t + 4);
      four_tokens<DV, (GT < 4 ? GT : 4)>(q, k + t * D, scores + t, stride);
      if constexpr (GT > 4) four_tokens<DV, GT - 4>(q + 4 * D, k + t * D, scores + 4 * stride + t, stride);
    }
    return t;
  }
  template <int DV, int H, typename T>
  static void four_tokens(const float* q, const T* k, float* scores, int64_t stride) {
    constexpr int64_t D = DV * kW;
    f32x16 a[4][H];
    auto chunk = [&](int c, auto first) __attribute__((always_inline)) {
      f32x16 qv[H];
      for (int h = 0; h < H; ++h) qv[h] = load(q + h * D + c * kW);
      for (int i = 0; i < 4; ++i) {
        const f32x16 kv = load16(k + i * D + c * kW);
        for (int h = 0; h < H; ++h) a[i][h] = first ? qv[h] * kv : a[i][h] + qv[h] * kv;
      }
    };
    chunk(0, std::true_type{});  // sets the accumulators: no zeroing, which GCC does in memory
    for (int c = 1; c < DV; ++c) chunk(c, std::false_type{});
    for (int h = 0; h < H; ++h) store_4_tokens(a[0][h], a[1][h], a[2][h], a[3][h], 1.f, scores + h * stride);
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
    constexpr int P = GT * 8 <= 16 ? 8 : GT * 4 <= 16 ? 4 : 2;
    int64_t d = 0;
    for (; d + P * kW <= D; d += P * kW) panel<P>(p, stride, v, n, D, acc, d, pf);
    if constexpr (P > 4) for (; d + 4 * kW <= D; d += 4 * kW) panel<4>(p, stride, v, n, D, acc, d, pf);
    if constexpr (P > 2) for (; d + 2 * kW <= D; d += 2 * kW) panel<2>(p, stride, v, n, D, acc, d, pf);
    for (; d + kW <= D; d += kW) panel<1>(p, stride, v, n, D, acc, d, pf);
    pf.upto(pf.rows);
    for (; d < D; ++d)
      for (int64_t t = 0; t < n; ++t)
        for (int g = 0; g < GT; ++g) acc[g * D + d] += p[g * stride + t] * element_value(v[t * D + d]);
  }
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
