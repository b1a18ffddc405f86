// The microkernels of prefill's lane path (prefill_tile.h): kLanes query rows along the vector
// lanes (lanes.h: 16 on AVX-512, 8 on AVX2) against kLanes keys at a time, float32 and (with
// AVX512-BF16) bfloat16-pair forms. Included only by prefill_tile.h, once per instruction-set
// object (cpu/isa.h).
#pragma once

#include <cstdint>

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
// horizontal sums; the FLOPs run as a kLanes x kLanes outer-product GEMM microkernel. The scores come out
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

// s[t] (lane r) = q_r . k_t over the kLanes key rows of k (row stride D).
template <int D>
inline void lane_scores(const float* qt, const float* k, Lanes (&s)[kLanes]) {
  for (int t = 0; t < kLanes; ++t) s[t] = lanes_zero();
  for (int d = 0; d < D; ++d) {
    const Lanes q = lanes_load(qt + d * kLanes);
#pragma GCC unroll 16
    for (int t = 0; t < kLanes; ++t) s[t] = lanes_fmadd(q, lanes_set1(k[t * D + d]), s[t]);
  }
}

// The frame of both P.V updates: per kLanes-element head-dim panel, the accumulator tile (kLanes
// x kLanes rows) is loaded, rescaled, handed to `add` (the keys' contributions, in registers), stored.
template <int D, typename Add>
__attribute__((always_inline)) inline void update_output_tiles(float* ot, Lanes rescale, bool rescaled, Add add) {
  for (int d0 = 0; d0 < D; d0 += kLanes) {
    Lanes a[kLanes];
#pragma GCC unroll 16
    for (int j = 0; j < kLanes; ++j) {
      a[j] = lanes_load(ot + (d0 + j) * kLanes);
      if (rescaled) a[j] = lanes_mul(a[j], rescale);
    }
    add(a, d0);
#pragma GCC unroll 16
    for (int j = 0; j < kLanes; ++j) lanes_store(ot + (d0 + j) * kLanes, a[j]);
  }
}

// ot[d] (lane r) = rescale * ot[d] + sum_t p[t] * v[t][d] over the kLanes value rows of v.
template <int D>
inline void lane_accumulate(const float* p, const float* v, float* ot, Lanes rescale, bool rescaled) {
  update_output_tiles<D>(ot, rescale, rescaled, [&](Lanes (&a)[kLanes], int d0) __attribute__((always_inline)) {
    for (int t = 0; t < kLanes; ++t) {
      const Lanes pt = lanes_load(p + t * kLanes);
#pragma GCC unroll 16
      for (int j = 0; j < kLanes; ++j) a[j] = lanes_fmadd(pt, lanes_set1(v[t * D + d0 + j]), a[j]);
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
inline void lane_accumulate_pairs(const __m512i* p, const uint32_t* v_pairs, float* ot, __m512 rescale,
                                  bool rescaled) {
  update_output_tiles<D>(ot, rescale, rescaled, [&](__m512 (&a)[kLanes], int d0) __attribute__((always_inline)) {
    for (int i = 0; i < kLanes / 2; ++i) {
      const __m512bh pi = (__m512bh)p[i];
#pragma GCC unroll 16
      for (int j = 0; j < kLanes; ++j)
        a[j] = _mm512_dpbf16_ps(a[j], pi, (__m512bh)_mm512_set1_epi32(static_cast<int>(v_pairs[i * D + d0 + j])));
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
