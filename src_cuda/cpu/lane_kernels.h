// The microkernels of prefill's lane path (prefill_tile.h): kLanes query rows along the vector
// lanes (lanes.h: 16 on AVX-512, 8 on AVX2) against kLanes keys at a time, float32 and (with
// AVX512-BF16) bfloat16-pair forms. Included only by prefill_tile.h, once per instruction-set
// object (cpu/isa.h).
#pragma once

#include <cstdint>
#include <type_traits>

#include "cpu/isa.h"
#include "cpu/lanes.h"
#include "cpu/vec.h"

namespace minipaged::MINIPAGED_CPU_ISA {
namespace {

#if defined(MINIPAGED_LANES)
// The lane path: query rows along the vector lanes.
//
// A row group is kLanes rows of the tile, one per lane. The query is transposed once per work item
// into qt ([head_dim][kLanes] per row group), so S^T for a chunk of kLanes keys is kLanes accumulators, one
// per key: for each head-dim element, one qt vector times that key's element broadcast straight
// from its cache row (an FMA with a memory broadcast operand). No per-block transposition and no
// horizontal sums; the FLOPs run as an outer-product GEMM microkernel (kStepGroups below). The scores come out
// as one vector per key with the rows in the lanes, so the online softmax (max, rescale, exp,
// sum) is lane-wise too, and P.V is rank-1 updates of O^T ([head_dim][16] per row group): a value
// element broadcast times a vector of 16 rows' probabilities. The running-max rescale of O^T is a
// lane-wise multiply folded into the loads of the P.V tile.
//
// bfloat16 (AVX512-BF16) does both products with the pair dot product: qt holds (d, d+1) pairs
// of each row, the broadcast is a key's (d, d+1) pair; for P.V the chunk's value rows are
// interleaved two keys at a time, (v[2i][d], v[2i+1][d]), against probability pairs
// (p[2i][r], p[2i+1][r]) rounded to bfloat16 (as FlashAttention does for P.V; the softmax state
// and both products' sums stay float32). float16, 8-bit caches, and bfloat16 without AVX512-BF16
// (AVX2 among them) convert each chunk's K/V rows to float once per work item and take the float32 path.

// Row groups the float32 microkernels take at once, and keys (Q.K) or head-dim elements (P.V) per
// pass over them. One row group against all kLanes keys costs a load per FMA: the query vector plus
// a broadcast per key (AVX-512 folds it into the FMA as a memory operand, still a load), so both
// ISAs' loops were bound by their two loads a cycle, not their two FMAs (AVX2's 8 chains at 4-cycle
// latency besides; ~72% of the FMA peak on an Ice Lake Xeon, in perf). Three row groups share each
// broadcast: AVX2 three against 4 keys, 7 loads per 12 FMAs in 12 chains, in all 16 ymm registers
// (12 sums, 3 query vectors, a broadcast); AVX-512 three against 8 keys, 11 loads per 24 FMAs in 28
// of its 32. Prefill from 2,048 cached tokens got 1.2-1.4x faster on either (bench/RESULTS.md).
constexpr int kStepGroups = 3;
constexpr int kStepKeys = kLanes == 8 ? 4 : 8;

// f(std::integral_constant<int, n>{}) for a run-time n in [1, N]: how many row groups a step has.
template <int N, typename F>
__attribute__((always_inline)) inline void with_count(int64_t n, F&& f) {
  if constexpr (N > 1)
    if (n < N) return with_count<N - 1>(n, f);
  f(std::integral_constant<int, N>{});
}

// s[g][t] (lane r) = q_r . k_t for the G row groups of qt (group g at qt + g * group_stride) over
// the kLanes key rows of k (row stride D).
template <int D, int G>
inline void lane_scores(const float* qt, int64_t group_stride, const float* k, Lanes (&s)[G][kLanes]) {
  for (int t0 = 0; t0 < kLanes; t0 += kStepKeys) {
    Lanes a[G][kStepKeys];
#pragma GCC unroll 16
    for (int g = 0; g < G; ++g)
#pragma GCC unroll 16
      for (int t = 0; t < kStepKeys; ++t) a[g][t] = lanes_zero();
    for (int d = 0; d < D; ++d) {
      Lanes q[G];
#pragma GCC unroll 16
      for (int g = 0; g < G; ++g) q[g] = lanes_load(qt + g * group_stride + d * kLanes);
#pragma GCC unroll 16
      for (int t = 0; t < kStepKeys; ++t) {
        const Lanes key = lanes_set1(k[(t0 + t) * D + d]);
#pragma GCC unroll 16
        for (int g = 0; g < G; ++g) a[g][t] = lanes_fmadd(q[g], key, a[g][t]);
      }
    }
#pragma GCC unroll 16
    for (int g = 0; g < G; ++g)
#pragma GCC unroll 16
      for (int t = 0; t < kStepKeys; ++t) s[g][t0 + t] = a[g][t];
  }
}

// The frame of both P.V updates: per J-element head-dim panel, the G row groups' accumulator tiles
// (J x kLanes rows each; group g's at ot + g * D * kLanes) are loaded, rescaled, handed to `add`
// (the keys' contributions, in registers), stored.
template <int D, int G, int J, typename Add>
__attribute__((always_inline)) inline void update_output_tiles(float* ot, const Lanes (&rescale)[G],
                                                               const bool (&rescaled)[G], Add add) {
  for (int d0 = 0; d0 < D; d0 += J) {
    Lanes a[G][J];
#pragma GCC unroll 16
    for (int g = 0; g < G; ++g)
#pragma GCC unroll 16
      for (int j = 0; j < J; ++j) {
        a[g][j] = lanes_load(ot + g * D * kLanes + (d0 + j) * kLanes);
        if (rescaled[g]) a[g][j] = lanes_mul(a[g][j], rescale[g]);
      }
    add(a, d0);
#pragma GCC unroll 16
    for (int g = 0; g < G; ++g)
#pragma GCC unroll 16
      for (int j = 0; j < J; ++j) lanes_store(ot + g * D * kLanes + (d0 + j) * kLanes, a[g][j]);
  }
}

// ot_g[d] (lane r) = rescale[g] * ot_g[d] + sum_t p_g[t] * v[t][d] over the kLanes value rows of v,
// for the G row groups (p_g: kLanes vectors at p + g * kLanes * kLanes).
template <int D, int G>
inline void lane_accumulate(const float* p, const float* v, float* ot, const Lanes (&rescale)[G],
                            const bool (&rescaled)[G]) {
  update_output_tiles<D, G, kStepKeys>(ot, rescale, rescaled,
                                       [&](Lanes (&a)[G][kStepKeys], int d0) __attribute__((always_inline)) {
    for (int t = 0; t < kLanes; ++t) {
      Lanes pt[G];
#pragma GCC unroll 16
      for (int g = 0; g < G; ++g) pt[g] = lanes_load(p + (g * kLanes + t) * kLanes);
#pragma GCC unroll 16
      for (int j = 0; j < kStepKeys; ++j) {
        const Lanes value = lanes_set1(v[t * D + d0 + j]);
#pragma GCC unroll 16
        for (int g = 0; g < G; ++g) a[g][j] = lanes_fmadd(pt[g], value, a[g][j]);
      }
    }
  });
}

#if defined(__AVX512BF16__)
// lane_scores with the pair dot product: qt holds ([D/2][16]) each row's (d, d+1) pairs, the
// broadcast is the key's pair; unscaled (the query stays bfloat16), so the caller scales.
template <int D>
inline void lane_scores_pairs(const uint32_t* qt, const c10::BFloat16* k, __m512 (&s)[kLanes]) {
  const int* kp = reinterpret_cast<const int*>(k);
  for (int t = 0; t < kLanes; ++t) s[t] = _mm512_setzero_ps();
  for (int i = 0; i < D / 2; ++i) {
    const __m512bh q = (__m512bh)_mm512_load_si512(qt + i * kLanes);
#pragma GCC unroll 16
    for (int t = 0; t < kLanes; ++t)
      s[t] = _mm512_dpbf16_ps(s[t], q, (__m512bh)_mm512_set1_epi32(kp[t * D / 2 + i]));
  }
}

// lane_accumulate with the pair dot product over keys (2i, 2i+1): p[i] holds each row's
// probability pair, v_pairs ([8][D]) the interleaved value rows (pair_rows).
template <int D>
inline void lane_accumulate_pairs(const __m512i* p, const uint32_t* v_pairs, float* ot, const __m512 (&rescale)[1],
                                  const bool (&rescaled)[1]) {
  update_output_tiles<D, 1, kLanes>(ot, rescale, rescaled, [&](__m512 (&a)[1][kLanes], int d0) __attribute__((always_inline)) {
    for (int i = 0; i < kLanes / 2; ++i) {
      const __m512bh pi = (__m512bh)p[i];
#pragma GCC unroll 16
      for (int j = 0; j < kLanes; ++j)
        a[0][j] = _mm512_dpbf16_ps(a[0][j], pi, (__m512bh)_mm512_set1_epi32(static_cast<int>(v_pairs[i * D + d0 + j])));
    }
  });
}

// v_pairs[i][d] = (v[2i][d], v[2i+1][d]) as a bfloat16 pair (the first in the low half, as in
// the probability pairs), for the 16 rows of v.
template <int D>
inline void pair_rows(const c10::BFloat16* v, uint32_t* v_pairs) {
  alignas(64) static constexpr uint16_t kLow[32] = {0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
                                                    8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
  const __m512i low = _mm512_load_si512(kLow), high = _mm512_add_epi16(low, _mm512_set1_epi16(16));
  for (int i = 0; i < kLanes / 2; ++i)
    for (int c = 0; c < D; c += 32) {
      const __m512i a = _mm512_loadu_si512(v + 2 * i * D + c), b = _mm512_loadu_si512(v + (2 * i + 1) * D + c);
      _mm512_store_si512(v_pairs + i * D + c, _mm512_permutex2var_epi16(a, low, b));
      _mm512_store_si512(v_pairs + i * D + c + 16, _mm512_permutex2var_epi16(a, high, b));
    }
}

// p[i] (lane r) = (s[2i] lane r, s[2i+1] lane r) rounded to a bfloat16 pair.
inline void pair_probabilities(const __m512 (&s)[kLanes], __m512i* p) {
  alignas(64) static constexpr uint16_t kInterleave[32] = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23,
                                                           8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
  const __m512i interleave = _mm512_load_si512(kInterleave);
  for (int i = 0; i < kLanes / 2; ++i)
    p[i] = _mm512_permutexvar_epi16(interleave, (__m512i)_mm512_cvtne2ps_pbh(s[2 * i + 1], s[2 * i]));
}
#endif
#endif

}  // namespace
}  // namespace minipaged::MINIPAGED_CPU_ISA
