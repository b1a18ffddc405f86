// The vector of prefill's lane path (prefill_tile.h, lane_kernels.h; kLanes floats, one query
// row per lane) and of linear.cpp's streamed weights. The work loops are written once against these few operations; only this file
// knows the instruction set. AVX-512: 16 lanes in a zmm register, each operation the one
// intrinsic the loops used before this header existed (so that variant's code is unchanged).
// AVX2 + FMA: 8 lanes in a ymm register; a tile of 8 rows x 8 keys keeps 8 accumulators, one
// query vector and one broadcast in 10 of the 16 registers (16 x 16 would need 32 and spill), and
// 8 independent FMA chains cover Zen 3's and Intel's 4-cycle FMA latency at 2 FMAs a cycle.
// Anonymous namespace for the reason vec.h gives.
#pragma once

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cstdint>
#include <limits>

#include "cpu/vec.h"

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__) && defined(__F16C__))
#define MINIPAGED_LANES 1
#endif

namespace minipaged {
namespace {

#if defined(__AVX512F__)
constexpr int kLanes = 16;  // rows per row group, keys per chunk
using Lanes = __m512;
using LaneInts = __m512i;
inline Lanes lanes_load(const float* p) { return _mm512_load_ps(p); }
// Unaligned loads widened to float32: bfloat16 is float32's upper half (a shift), float16 converts
// in hardware (linear.cpp's streamed weights).
inline Lanes lanes_loadu(const float* p) { return _mm512_loadu_ps(p); }
inline Lanes lanes_loadu(const c10::BFloat16* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}
inline Lanes lanes_loadu(const c10::Half* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
inline Lanes lanes_loadu(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
// Vector v of the 32 int4 weights at p (16 bytes; byte i holds weight i in its low nibble and
// weight 16 + i in its high one, linear.cpp's layout; weights v * kLanes onwards), dequantized as
// q * scale + shift of their group: on AVX-512 the 16 values a group can take
// are one vector, and vpermps looks 16 weights up at once (it reads an index's low 4 bits only, so
// the low nibbles need no mask): 4 operations per 32 weights where converting takes 7.
struct Int4Table {
  Lanes values;
};
inline Int4Table lanes_int4_table(float scale, float shift) {
  const __m512 q = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  return {_mm512_fmadd_ps(q, _mm512_set1_ps(scale), _mm512_set1_ps(shift))};
}
inline Lanes lanes_int4_lookup(const uint8_t* p, int v, const Int4Table& table) {
  const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm512_permutexvar_ps(v == 0 ? bytes : _mm512_srli_epi32(bytes, 4), table.values);
}
inline float lanes_hsum(Lanes v) { return _mm512_reduce_add_ps(v); }
inline float lanes_hmax(Lanes v) { return _mm512_reduce_max_ps(v); }
inline Lanes lanes_abs(Lanes v) { return _mm512_abs_ps(v); }
// The first min(count, kLanes) floats at p, zeros after them (nothing past them is read).
inline Lanes lanes_load_first(const float* p, int64_t count) { return _mm512_maskz_loadu_ps(first_lanes(count), p); }
// v rounded to the nearest int16s (saturated), kLanes of them at p.
inline void lanes_store_int16(int16_t* p, Lanes v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtsepi32_epi16(_mm512_cvtps_epi32(v)));
}
#if defined(__AVX512VNNI__)
// 16-bit integer pairs (tile_int8.h): 2 * kLanes int16s, kLanes int32 sums; pairs_dot adds each
// lane's two products to its sum exactly, in one instruction (vpdpwssd).
#define MINIPAGED_INT16_PAIRS 1
using PairInts = __m512i;
inline PairInts pairs_zero() { return _mm512_setzero_si512(); }
inline PairInts pairs_load(const int16_t* p) { return _mm512_loadu_si512(p); }
inline PairInts pairs_widen_int8(const int8_t* p) {
  return _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline PairInts pairs_set1(uint32_t pair) { return _mm512_set1_epi32(static_cast<int>(pair)); }
inline PairInts pairs_unpacklo(PairInts a, PairInts b) { return _mm512_unpacklo_epi16(a, b); }
inline PairInts pairs_unpackhi(PairInts a, PairInts b) { return _mm512_unpackhi_epi16(a, b); }
inline PairInts pairs_dot(PairInts sums, PairInts a, PairInts b) { return _mm512_dpwssd_epi32(sums, a, b); }
inline Lanes pairs_to_float(PairInts sums) { return _mm512_cvtepi32_ps(sums); }
// The four vectors' sums, exact.
inline i32x4 pairs_hsum4(PairInts a, PairInts b, PairInts c, PairInts d) {
  using i32x16 = int32_t __attribute__((vector_size(64)));
  auto as_i32 = [](PairInts v) { return reinterpret_cast<const i32x16&>(v); };
  return hsum4(as_i32(a), as_i32(b), as_i32(c), as_i32(d));
}
#endif
inline void lanes_store(float* p, Lanes v) { _mm512_store_ps(p, v); }
inline void lanes_storeu(float* p, Lanes v) { _mm512_storeu_ps(p, v); }
inline LaneInts lanes_load_ints(const void* p) { return _mm512_load_si512(p); }
inline Lanes lanes_set1(float x) { return _mm512_set1_ps(x); }
inline Lanes lanes_zero() { return _mm512_setzero_ps(); }
inline Lanes lanes_fmadd(Lanes a, Lanes b, Lanes c) { return _mm512_fmadd_ps(a, b, c); }
inline Lanes lanes_add(Lanes a, Lanes b) { return _mm512_add_ps(a, b); }
inline Lanes lanes_sub(Lanes a, Lanes b) { return _mm512_sub_ps(a, b); }
inline Lanes lanes_mul(Lanes a, Lanes b) { return _mm512_mul_ps(a, b); }
inline Lanes lanes_div(Lanes a, Lanes b) { return _mm512_div_ps(a, b); }
inline Lanes lanes_max(Lanes a, Lanes b) { return _mm512_max_ps(a, b); }
// s in the lanes whose position is at least `key` (the key exists: `exists`), else -inf.
inline Lanes lanes_visible(Lanes s, LaneInts positions, int32_t key, bool exists) {
  const __mmask16 visible = exists ? _mm512_cmp_epi32_mask(positions, _mm512_set1_epi32(key), _MM_CMPINT_NLT) : 0;
  return _mm512_mask_mov_ps(_mm512_set1_ps(-std::numeric_limits<float>::infinity()), visible, s);
}
// Whether any lane differs from 1 (or is NaN).
inline bool lanes_any_not_one(Lanes v) { return _mm512_cmp_ps_mask(v, _mm512_set1_ps(1.f), _CMP_NEQ_UQ) != 0; }
// flatten: exp16 inlined here, where 17 calls per row group and chunk would otherwise cost calls.
__attribute__((always_inline, flatten)) inline Lanes lanes_exp(Lanes x) {
  const f32x16 e = exp16(reinterpret_cast<const f32x16&>(x));
  return reinterpret_cast<const Lanes&>(e);
}
#elif defined(MINIPAGED_LANES)
constexpr int kLanes = 8;
using Lanes = __m256;
using LaneInts = __m256i;
inline Lanes lanes_load(const float* p) { return _mm256_load_ps(p); }
inline Lanes lanes_loadu(const float* p) { return _mm256_loadu_ps(p); }
inline Lanes lanes_loadu(const c10::BFloat16* p) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
}
inline Lanes lanes_loadu(const c10::Half* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline Lanes lanes_loadu(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
// The weights as float32 (bytes 0-7 hold weights 0-7 and 16-23, bytes 8-15 the rest).
inline Lanes lanes_load_int4(const uint8_t* p, int v) {
  const __m256i bytes = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8 * (v & 1))));
  return _mm256_cvtepi32_ps(v < 2 ? _mm256_and_si256(bytes, _mm256_set1_epi32(0xF)) : _mm256_srli_epi32(bytes, 4));
}
// AVX2's vpermps takes 8 entries, not a group's 16: the weights are converted and scaled instead.
struct Int4Table {
  Lanes scale, shift;
};
inline Int4Table lanes_int4_table(float scale, float shift) { return {_mm256_set1_ps(scale), _mm256_set1_ps(shift)}; }
inline Lanes lanes_int4_lookup(const uint8_t* p, int v, const Int4Table& table) {
  return _mm256_fmadd_ps(lanes_load_int4(p, v), table.scale, table.shift);
}
inline float lanes_hsum(Lanes v) {
  const __m128 half = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 quarter = _mm_add_ps(half, _mm_movehl_ps(half, half));
  return _mm_cvtss_f32(_mm_add_ss(quarter, _mm_movehdup_ps(quarter)));
}
inline float lanes_hmax(Lanes v) {
  const __m128 half = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 quarter = _mm_max_ps(half, _mm_movehl_ps(half, half));
  return _mm_cvtss_f32(_mm_max_ss(quarter, _mm_movehdup_ps(quarter)));
}
inline Lanes lanes_abs(Lanes v) { return _mm256_andnot_ps(_mm256_set1_ps(-0.f), v); }
inline Lanes lanes_load_first(const float* p, int64_t count) {
  const __m256i live = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(std::min<int64_t>(count, kLanes))),
                                          _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  return _mm256_maskload_ps(p, live);
}
inline void lanes_store_int16(int16_t* p, Lanes v) {
  const __m256i i = _mm256_cvtps_epi32(v);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm_packs_epi32(_mm256_castsi256_si128(i), _mm256_extracti128_si256(i, 1)));
}
// 16-bit integer pairs: AVX2 has no vpdpwssd, but vpmaddwd (the pairs' products summed into
// int32, exact) and an add are still fewer instructions than widening int8 to float32 twice.
#define MINIPAGED_INT16_PAIRS 1
using PairInts = __m256i;
inline PairInts pairs_zero() { return _mm256_setzero_si256(); }
inline PairInts pairs_load(const int16_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
inline PairInts pairs_widen_int8(const int8_t* p) {
  return _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline PairInts pairs_set1(uint32_t pair) { return _mm256_set1_epi32(static_cast<int>(pair)); }
inline PairInts pairs_unpacklo(PairInts a, PairInts b) { return _mm256_unpacklo_epi16(a, b); }
inline PairInts pairs_unpackhi(PairInts a, PairInts b) { return _mm256_unpackhi_epi16(a, b); }
inline PairInts pairs_dot(PairInts sums, PairInts a, PairInts b) { return _mm256_add_epi32(sums, _mm256_madd_epi16(a, b)); }
inline Lanes pairs_to_float(PairInts sums) { return _mm256_cvtepi32_ps(sums); }
inline i32x4 pairs_hsum4(PairInts a, PairInts b, PairInts c, PairInts d) {
  // Per 128-bit lane [a, b, c, d] partial sums after two pairwise adds, then the halves added.
  const __m256i abcd = _mm256_hadd_epi32(_mm256_hadd_epi32(a, b), _mm256_hadd_epi32(c, d));
  const __m128i s = _mm_add_epi32(_mm256_castsi256_si128(abcd), _mm256_extracti128_si256(abcd, 1));
  return reinterpret_cast<const i32x4&>(s);
}
inline void lanes_store(float* p, Lanes v) { _mm256_store_ps(p, v); }
inline void lanes_storeu(float* p, Lanes v) { _mm256_storeu_ps(p, v); }
inline LaneInts lanes_load_ints(const void* p) { return _mm256_load_si256(static_cast<const __m256i*>(p)); }
inline Lanes lanes_set1(float x) { return _mm256_set1_ps(x); }
inline Lanes lanes_zero() { return _mm256_setzero_ps(); }
inline Lanes lanes_fmadd(Lanes a, Lanes b, Lanes c) { return _mm256_fmadd_ps(a, b, c); }
inline Lanes lanes_add(Lanes a, Lanes b) { return _mm256_add_ps(a, b); }
inline Lanes lanes_sub(Lanes a, Lanes b) { return _mm256_sub_ps(a, b); }
inline Lanes lanes_mul(Lanes a, Lanes b) { return _mm256_mul_ps(a, b); }
inline Lanes lanes_div(Lanes a, Lanes b) { return _mm256_div_ps(a, b); }
inline Lanes lanes_max(Lanes a, Lanes b) { return _mm256_max_ps(a, b); }
inline Lanes lanes_visible(Lanes s, LaneInts positions, int32_t key, bool exists) {
  const Lanes neg_inf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  if (!exists) return neg_inf;
  const __m256i hidden = _mm256_cmpgt_epi32(_mm256_set1_epi32(key), positions);  // position < key
  return _mm256_blendv_ps(s, neg_inf, _mm256_castsi256_ps(hidden));
}
inline bool lanes_any_not_one(Lanes v) {
  return _mm256_movemask_ps(_mm256_cmp_ps(v, _mm256_set1_ps(1.f), _CMP_NEQ_UQ)) != 0;
}
__attribute__((always_inline, flatten)) inline Lanes lanes_exp(Lanes x) {
  const f32x8 e = exp_vector(reinterpret_cast<const f32x8&>(x));
  return reinterpret_cast<const Lanes&>(e);
}
// 16 cache elements widened to float32 as two vectors, for every cache dtype (decode's P.V on
// AVX2, tile_float.h): load16's f32x16 would have GCC split it again through single-float inserts.
template <typename T>  // float, bfloat16, float16, int8: lanes_loadu widens them
inline void lanes_load16(const T* p, Lanes& lo, Lanes& hi) { lo = lanes_loadu(p), hi = lanes_loadu(p + 8); }
// fp8: vec.h's half_bits (the bytes as float16 bits), converted by F16C.
inline void lanes_half_bits(u16x16 bits, Lanes& lo, Lanes& hi) {
  const __m256i all = reinterpret_cast<const __m256i&>(bits);
  lo = _mm256_cvtph_ps(_mm256_castsi256_si128(all)), hi = _mm256_cvtph_ps(_mm256_extracti128_si256(all, 1));
}
inline void lanes_load16(const bf16_pairs* p, Lanes& even, Lanes& odd) {
  const __m256i pairs = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  even = _mm256_castsi256_ps(_mm256_slli_epi32(pairs, 16));
  odd = _mm256_castsi256_ps(_mm256_and_si256(pairs, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
}
// vec.h's fp8_pairs: the sign-extended byte, shifted, has copies of its sign above it, and the mask
// keeps the one in bit 31.
template <typename T>
inline void lanes_load16(const fp8_pairs<T>* p, Lanes& even, Lanes& odd) {
  const __m256i wide = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m256i mask = _mm256_set1_epi32(static_cast<int>(kFp8PairsMask<T>));
  even = _mm256_castsi256_ps(_mm256_and_si256(_mm256_slli_epi32(wide, kFp8PairsShift<T>), mask));
  odd = _mm256_castsi256_ps(_mm256_and_si256(_mm256_slli_epi32(wide, kFp8PairsShift<T> - 16), mask));
}
// Whether the fp8 pair order may be used: not where denormals are read as zero (MXCSR's DAZ, as
// torch.set_flush_denormal sets it), which would zero its subnormals.
inline bool fp8_pairs_allowed() { return (_mm_getcsr() & (1u << 6)) == 0; }
// The same as one f32x16, for the Q.K tiles (vec.h's load16 overloads). P: bf16_pairs or fp8_pairs.
template <typename P>
inline f32x16 load16_of_pairs(const P* p) {
  Lanes halves[2];
  lanes_load16(p, halves[0], halves[1]);
  f32x16 out;
  std::memcpy(&out, halves, sizeof(out));
  return out;
}
inline f32x16 load16(const bf16_pairs* p) { return load16_of_pairs(p); }
template <typename T>
inline f32x16 load16(const fp8_pairs<T>* p) { return load16_of_pairs(p); }
inline void lanes_load16(const fp8_e5m2* p, Lanes& lo, Lanes& hi) { lanes_half_bits(half_bits(p), lo, hi); }
inline void lanes_load16(const fp8_e4m3* p, Lanes& lo, Lanes& hi) { lanes_half_bits(half_bits(p), lo, hi); }
#endif

}  // namespace
}  // namespace minipaged
