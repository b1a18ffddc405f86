// K/V rows as bfloat16 bits for the pair dot products of tile_bf16.h: bfloat16 rows as they are,
// fp8 rows converted exactly (bf16x32, 32 at a time), or looked up 64 at a time (bf16x64).
#pragma once

#include "cpu/vec.h"

namespace minipaged {
namespace {

#if defined(__AVX512BF16__)
// 32 cache elements as bfloat16 bits, for the pair dot products. bfloat16 rows load as they are.
// An fp8 byte's exponent and mantissa fields move into a bfloat16's, with the exponent rebased so
// that it reads as the byte's value times kRawFactor (the factor load16 gives it, so the kernels'
// scales stay as they are): e4m3 2^-8 (exponent + 112, an OR into bits that are zero), e5m2 1
// (exponent + 112, an add). The pair dot product reads bfloat16 subnormals as zero, so the fp8
// subnormals (exponent 0) come from a small table instead, as normal bfloat16 numbers; e5m2's
// infinities and NaN (exponent 31) become bfloat16's. Exact for every byte (tests/test_quantized_kv.py
// compares each format's decode with the float64 reference, subnormals included, and a one-token
// decode returns every code bit for bit). 7 instructions per 32 e4m3 elements (9 for e5m2) instead
// of widening to float32 twice, and then half as many multiply-add instructions: 1.4x faster than
// load32 + fmadd in a throwaway in-cache loop on Zen 4. The kernels take 64 at a time (bf16x64),
// which looks the bytes up instead where the CPU has AVX512-VBMI and no AMX.
inline __m512i bf16x32(const c10::BFloat16* p) { return _mm512_loadu_si512(p); }
// The bfloat16 bits of m x 2^e for a small integer m (0 < m < 8).
constexpr uint16_t bf16_bits_of(int m, int e) {
  const int top = m >= 4 ? 2 : m >= 2 ? 1 : 0;  // m = 2^top x 1.f
  return static_cast<uint16_t>((127 + e + top) << 7 | ((m << (7 - top)) & 0x7f));
}
// The table the fp8 conversions look their exponent-0 codes up in, indexed by the low 5 bits of
// the byte: e4m3's subnormals m x 2^-9 times 2^-8 at m = 0-7; e5m2's m x 2^-16 at m = 0-3, and its
// exponent-31 codes (low bits 111mm) at 28-31, infinity then NaN.
struct Fp8Tables {
  alignas(64) uint16_t e4m3[32] = {};
  alignas(64) uint16_t e5m2[32] = {};
  constexpr Fp8Tables() {
    for (int m = 1; m < 8; ++m) e4m3[m] = bf16_bits_of(m, -17);
    for (int m = 1; m < 4; ++m) e5m2[m] = bf16_bits_of(m, -16);
    for (int m = 0; m < 4; ++m) e5m2[28 + m] = static_cast<uint16_t>(0x7f80 | m << 5);
  }
};
constexpr Fp8Tables kFp8Tables{};
static_assert(bf16_bits_of(1, -17) == 0x3700 && bf16_bits_of(3, -16) == 0x3840 && bf16_bits_of(7, -17) == 0x3860);
inline __m512i bf16x32(const fp8_e4m3* p) {
  const __m512i wide = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  const __m512i fields = _mm512_slli_epi16(wide, 4);  // sign in bits 15-11, exponent 10-7, mantissa 6-4
  // (fields & 0x87ff) | 0x3800: the sign, and the exponent plus 112.
  const __m512i normal = _mm512_ternarylogic_epi32(fields, _mm512_set1_epi16(static_cast<short>(0x87ff)),
                                                   _mm512_set1_epi16(0x3800), 0xea);
  const __mmask32 subnormal = _mm512_testn_epi16_mask(fields, _mm512_set1_epi16(0x0780));
  // The low 5 bits of the widened byte are the mantissa when the exponent is 0.
  const __m512i magnitude = _mm512_permutexvar_epi16(wide, _mm512_load_si512(kFp8Tables.e4m3));
  // (normal & 0x8000) | magnitude: the table's value with the byte's sign.
  const __m512i signed_magnitude =
      _mm512_ternarylogic_epi32(normal, magnitude, _mm512_set1_epi16(static_cast<short>(0x8000)), 0xec);
  return _mm512_mask_blend_epi16(subnormal, normal, signed_magnitude);
}
inline __m512i bf16x32(const fp8_e5m2* p) {
  const __m512i wide = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  const __m512i fields = _mm512_slli_epi16(wide, 5);  // sign in bits 15-12, exponent 11-7, mantissa 6-5
  const __m512i normal = _mm512_add_epi16(_mm512_and_si512(fields, _mm512_set1_epi16(static_cast<short>(0x8fff))),
                                          _mm512_set1_epi16(0x3800));
  // Exponent 0 or 31: exponent + 1 (the byte's bits 2-6) is 1 or 32, so its bits 3-6 are all zero.
  const __mmask32 from_table =
      _mm512_testn_epi16_mask(_mm512_add_epi16(wide, _mm512_set1_epi16(4)), _mm512_set1_epi16(0x78));
  // The low 5 bits of the widened byte: the mantissa, and the exponent's low 3 bits (0 or 7 here).
  const __m512i magnitude = _mm512_permutexvar_epi16(wide, _mm512_load_si512(kFp8Tables.e5m2));
  const __m512i signed_magnitude =
      _mm512_ternarylogic_epi32(normal, magnitude, _mm512_set1_epi16(static_cast<short>(0x8000)), 0xec);
  return _mm512_mask_blend_epi16(from_table, normal, signed_magnitude);
}

// 64 cache elements as two registers of 32 bfloat16 (first: elements 0-31). fp8 with AVX512-VBMI:
// a byte's bfloat16 bits looked up whole, its low and its high byte each in a 128-entry table of
// the 7-bit magnitudes (vpermi2b looks up 64 bytes at once), the sign or-ed in, and the two bytes
// interleaved: 6 instructions for 64 elements where bf16x32 takes 14 (e4m3) or 18 (e5m2); fp8
// decode, with tile_bf16.h's P.V on the same tables, in cache 0.76x (e4m3) and 0.70x (e5m2) of the
// time on Zen 4 (bench/RESULTS.md). The tables hold bf16x32's results, spelled for constant
// evaluation, so the two agree on every byte. Everything else: two bf16x32.
template <typename T>
inline void bf16x64(const T* p, __m512i& first, __m512i& second) {
  first = bf16x32(p), second = bf16x32(p + 32);
}
// Not on the AMX variant: on the Intel Xeon measured, each byte permute cost ~1.3 cycles and an
// earlier lookup was slower than converting (bench/RESULTS.md, 2026-12-06 09:00).
#if defined(__AVX512VBMI__) && !defined(__AMX_BF16__)
#define MINIPAGED_FP8_LOOKUP 1
struct Fp8ByteTables {
  alignas(64) uint8_t lo[128] = {}, hi[128] = {};
  // Where each output byte comes from: lo[i] at i, hi[i] at 64 + i (vpermt2b's two sources).
  alignas(64) uint8_t first[64] = {}, second[64] = {};
  template <typename Bits>
  constexpr explicit Fp8ByteTables(Bits bits) {
    for (int c = 0; c < 128; ++c) lo[c] = static_cast<uint8_t>(bits(c) & 0xff), hi[c] = static_cast<uint8_t>(bits(c) >> 8);
    for (int i = 0; i < 32; ++i) {
      first[2 * i] = static_cast<uint8_t>(i), first[2 * i + 1] = static_cast<uint8_t>(64 + i);
      second[2 * i] = static_cast<uint8_t>(32 + i), second[2 * i + 1] = static_cast<uint8_t>(96 + i);
    }
  }
};
// bf16x32's bits for a non-negative code c (below 128), spelled for constant evaluation.
constexpr Fp8ByteTables kE4m3Bytes([](int c) {
  return static_cast<uint16_t>(c >> 3 == 0 ? kFp8Tables.e4m3[c] : (c << 4) | 0x3800);
});
constexpr Fp8ByteTables kE5m2Bytes([](int c) {
  return static_cast<uint16_t>(c >> 2 == 0 || c >> 2 == 31 ? kFp8Tables.e5m2[c & 31] : (c << 5) + 0x3800);
});
template <typename T>  // fp8_e4m3 or fp8_e5m2
constexpr const Fp8ByteTables& kFp8Bytes = std::is_same_v<T, fp8_e4m3> ? kE4m3Bytes : kE5m2Bytes;
template <typename T>
inline void bf16x64_lookup(const T* p, __m512i& first, __m512i& second) {
  const Fp8ByteTables& t = kFp8Bytes<T>;
  const __m512i bytes = _mm512_loadu_si512(p);
  const __m512i lo = _mm512_permutex2var_epi8(_mm512_load_si512(t.lo), bytes, _mm512_load_si512(t.lo + 64));
  const __m512i hi_magnitude = _mm512_permutex2var_epi8(_mm512_load_si512(t.hi), bytes, _mm512_load_si512(t.hi + 64));
  // hi_magnitude | (bytes & 0x80): the sign bit, the byte's top bit, which the lookup ignores.
  const __m512i hi = _mm512_ternarylogic_epi32(hi_magnitude, bytes, _mm512_set1_epi8(static_cast<char>(0x80)), 0xf8);
  first = _mm512_permutex2var_epi8(lo, _mm512_load_si512(t.first), hi);
  second = _mm512_permutex2var_epi8(lo, _mm512_load_si512(t.second), hi);
}
inline void bf16x64(const fp8_e4m3* p, __m512i& first, __m512i& second) { bf16x64_lookup(p, first, second); }
inline void bf16x64(const fp8_e5m2* p, __m512i& first, __m512i& second) { bf16x64_lookup(p, first, second); }
#endif
#endif

}  // namespace
}  // namespace minipaged
