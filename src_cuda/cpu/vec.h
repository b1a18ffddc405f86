// Vector helpers shared by the CPU attention kernels (kernels.cpp: decode, prefill.cpp: prefill):
// 16-float vectors, cache-dtype loads, exp, horizontal sums and the online-softmax step. The GQA
// head tile built on them is head_tile.h; the prefetch stream, row_prefetch.h.
//
// Everything is in an anonymous namespace on purpose: a file that includes this may be compiled
// several times with different -m flags (one object per ISA), and each object must keep its own
// copies instead of the linker picking one ISA's version for all.
#pragma once
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

#include "quant.h"

namespace minipaged {
namespace {

// The cache dtypes (check_cache_pair admits exactly these).
#define MINIPAGED_DISPATCH(TYPE, NAME, ...)                       \
  AT_DISPATCH_SWITCH(TYPE, NAME, AT_DISPATCH_CASE(at::kFloat, __VA_ARGS__) \
                         AT_DISPATCH_CASE(at::kHalf, __VA_ARGS__)          \
                             AT_DISPATCH_CASE(at::kBFloat16, __VA_ARGS__))

// 16-float vectors through GCC/Clang vector extensions: the compiler maps them onto AVX-512,
// AVX2 or NEON registers, so one source serves every CPU. Intrinsics appear only where the
// compiler's own lowering is slow (float16 conversion) or for AVX512-BF16 dot products.
constexpr int64_t kW = 16;
using f32x16 = float __attribute__((vector_size(64), aligned(4)));
using f32x8 = float __attribute__((vector_size(32), aligned(4)));
using f32x4 = float __attribute__((vector_size(16), aligned(4)));
using i32x4 = int32_t __attribute__((vector_size(16)));
using u16x16 = uint16_t __attribute__((vector_size(32), aligned(2)));
using u32x16 = uint32_t __attribute__((vector_size(64)));
using f16x16 = _Float16 __attribute__((vector_size(32), aligned(2)));

// How many 16-float vectors fit in the register file: AVX-512's 32 zmm; AVX2's 16 ymm hold 8 (each
// vector is two); SSE2 and NEON 128-bit registers, 4 or 8. The head tiles size their accumulators
// by it: a tile that does not fit spills to the stack on every multiply-add.
#if defined(__AVX512F__)
constexpr int kVectorRegisters = 32;
#elif defined(__AVX__) || defined(__aarch64__)
constexpr int kVectorRegisters = 8;
#else
constexpr int kVectorRegisters = 4;
#endif

inline f32x16 load(const float* p) { return *reinterpret_cast<const f32x16*>(p); }
inline void store(float* p, f32x16 v) { *reinterpret_cast<f32x16*>(p) = v; }
inline float hsum(f32x16 v) {
  f32x8 a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
            __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  f32x4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
  return (b[0] + b[2]) + (b[1] + b[3]);
}

inline float hmax(f32x8 a) {
  const f32x4 lo = __builtin_shufflevector(a, a, 0, 1, 2, 3), hi = __builtin_shufflevector(a, a, 4, 5, 6, 7);
  const f32x4 b = lo > hi ? lo : hi;
  return std::max(std::max(b[0], b[1]), std::max(b[2], b[3]));
}
inline float hmax(f32x16 v) {
  const f32x8 lo = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7),
              hi = __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  return hmax(lo > hi ? lo : hi);
}

// The four horizontal sums of a, b, c, d at once: a 4x4 transpose-and-add inside each 128-bit
// lane, then the lanes added. 13 shuffles and adds instead of 4 x 9 for four hsum calls, which
// matters because a decode kernel does one per token and query head.
// For 16-lane float32 or int32 vectors (int8 caches sum their exact int32 products first and
// convert the four totals once).
template <typename V16>
inline auto hsum4(V16 a, V16 b, V16 c, V16 d) {
  // Per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3] and the same for c, d.
  const V16 ab = __builtin_shufflevector(a, b, 0, 16, 1, 17, 4, 20, 5, 21, 8, 24, 9, 25, 12, 28, 13, 29) +
                 __builtin_shufflevector(a, b, 2, 18, 3, 19, 6, 22, 7, 23, 10, 26, 11, 27, 14, 30, 15, 31);
  const V16 cd = __builtin_shufflevector(c, d, 0, 16, 1, 17, 4, 20, 5, 21, 8, 24, 9, 25, 12, 28, 13, 29) +
                 __builtin_shufflevector(c, d, 2, 18, 3, 19, 6, 22, 7, 23, 10, 26, 11, 27, 14, 30, 15, 31);
  // Per lane: [a, b, c, d] partial sums.
  const V16 abcd = __builtin_shufflevector(ab, cd, 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29) +
                   __builtin_shufflevector(ab, cd, 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31);
  const auto half = __builtin_shufflevector(abcd, abcd, 0, 1, 2, 3, 4, 5, 6, 7) +
                    __builtin_shufflevector(abcd, abcd, 8, 9, 10, 11, 12, 13, 14, 15);
  return __builtin_shufflevector(half, half, 0, 1, 2, 3) + __builtin_shufflevector(half, half, 4, 5, 6, 7);
}

// exp(x) for a vector of floats (16: exp16; 8: the AVX2 lane path's): x = k ln2 + r,
// |r| <= ln2/2, exp(r) by a degree-6 Taylor polynomial (relative error < 2e-7 on that range), 2^k
// spliced into the exponent bits. Inputs below -87 flush to 0, which is what the softmax wants for
// far-below-max scores.
template <int kBytes>
struct IntVector;  // the int32 vector of as many bytes
template <>
struct IntVector<64> {
  using type = int32_t __attribute__((vector_size(64)));
};
template <>
struct IntVector<32> {
  using type = int32_t __attribute__((vector_size(32)));
};
template <typename V>
inline V exp_vector(V x) {
  using I = typename IntVector<sizeof(V)>::type;
  const V lo = V{} - 87.f;
  x = x < lo ? lo : x;
  const V k = __builtin_convertvector(__builtin_convertvector(x * 1.44269504f + (x < 0 ? -0.5f : 0.5f) , I), V);
  const V r = x - k * 0.693145751953125f - k * 1.428606765330187e-06f;
  V p = 1.f / 720 + V{};
  p = p * r + 1.f / 120;
  p = p * r + 1.f / 24;
  p = p * r + 1.f / 6;
  p = p * r + 0.5f;
  p = p * r + 1.f;
  p = p * r + 1.f;
  const I bits = (__builtin_convertvector(k, I) + 127) << 23;
  V result = p * reinterpret_cast<const V&>(bits);
  return x <= lo ? V{} : result;
}
inline f32x16 exp16(f32x16 x) { return exp_vector(x); }

// 16 cache elements as floats, converted in registers (bfloat16 is the top half of a float;
// float16 converts in hardware where F16C exists), so K/V are read once, straight from the cache.
inline f32x16 load16(const float* p) { return load(p); }
inline f32x16 load16(const c10::BFloat16* p) {
#if defined(__AVX512F__)
  // GCC lowers the vector-extension widening below to five instructions (two half-width widenings,
  // an extract and an insert, then the shift); these are two. 1.4x faster in cache where the
  // bfloat16 kernel takes this path (no AVX512-BF16, or head_dim not a multiple of 32).
  const __m512i wide = _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16);
  return reinterpret_cast<const f32x16&>(wide);
#elif defined(__AVX2__)
  // The same on AVX2: each half zero-extended to 32 bits and shifted, four instructions.
  const __m128i* src = reinterpret_cast<const __m128i*>(p);
  const __m256i lo = _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(src)), 16);
  const __m256i hi = _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(src + 1)), 16);
  f32x16 out;
  std::memcpy(&out, &lo, sizeof(lo));
  std::memcpy(reinterpret_cast<char*>(&out) + sizeof(lo), &hi, sizeof(hi));
  return out;
#else
  u32x16 wide = __builtin_convertvector(*reinterpret_cast<const u16x16*>(p), u32x16) << 16;
  return reinterpret_cast<f32x16&>(wide);
#endif
}
inline f32x16 load16(const c10::Half* p) {
  // GCC turns a vector conversion of _Float16 into one instruction per element; the F16C /
  // AVX-512 conversion does all of them at once.
#if defined(__AVX512F__)
  const __m512 v = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return reinterpret_cast<const f32x16&>(v);
#elif defined(__F16C__)
  const __m256 lo = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m256 hi = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8)));
  f32x16 out;
  std::memcpy(&out, &lo, sizeof(lo));
  std::memcpy(reinterpret_cast<char*>(&out) + sizeof(lo), &hi, sizeof(hi));
  return out;
#else
  return __builtin_convertvector(*reinterpret_cast<const f16x16*>(p), f32x16);
#endif
}

// ---- 8-bit caches (quant.h): 16 elements as floats in a few instructions, before their scale.
// int8 widens in one instruction (and converts in another); an fp8 byte becomes a float16's bits
// (e5m2: its top byte; e4m3: its value x 2^-8, kRawFactor) and converts like float16. The kernels
// apply the scales outside these loops: fp8's per-layer scale / kRawFactor (raw_scale) folded into
// the query and the output, int8's per-token scales into the scores and probabilities.
template <typename T>
constexpr bool kFp8 = std::is_same_v<T, fp8_e4m3> || std::is_same_v<T, fp8_e5m2>;
template <typename T>
constexpr bool kQuantized = std::is_same_v<T, int8_t> || kFp8<T>;


inline f32x16 half_bits_to_float(u16x16 bits) {
#if defined(__AVX512F__)
  const __m512 v = _mm512_cvtph_ps(reinterpret_cast<const __m256i&>(bits));
  return reinterpret_cast<const f32x16&>(v);
#elif defined(__F16C__)
  const __m256i all = reinterpret_cast<const __m256i&>(bits);
  const __m256 lo = _mm256_cvtph_ps(_mm256_castsi256_si128(all));
  const __m256 hi = _mm256_cvtph_ps(_mm256_extracti128_si256(all, 1));
  f32x16 out;
  std::memcpy(&out, &lo, sizeof(lo));
  std::memcpy(reinterpret_cast<char*>(&out) + sizeof(lo), &hi, sizeof(hi));
  return out;
#else
  return __builtin_convertvector(reinterpret_cast<const f16x16&>(bits), f32x16);
#endif
}
// GCC lowers a vector-extension widening of bytes to one scalar conversion per element, so the
// widening is spelled with intrinsics where the ISA has them (7x faster in cache for int8).
inline f32x16 load16(const int8_t* p) {
#if defined(__AVX512F__)
  const __m512 v = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  return reinterpret_cast<const f32x16&>(v);
#elif defined(__AVX2__)
  const __m256 lo = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
  const __m256 hi = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8))));
  f32x16 out;
  std::memcpy(&out, &lo, sizeof(lo));
  std::memcpy(reinterpret_cast<char*>(&out) + sizeof(lo), &hi, sizeof(hi));
  return out;
#else
  f32x16 out;
  for (int i = 0; i < 16; ++i) out[i] = static_cast<float>(p[i]);
  return out;
#endif
}
// The 16 bytes at p widened to 16-bit lanes: zero-extended (e5m2) or sign-extended (e4m3).
template <bool kSigned>
inline u16x16 widen_bytes(const void* p) {
#if defined(__AVX2__)
  const __m128i bytes = _mm_loadu_si128(static_cast<const __m128i*>(p));
  const __m256i wide = kSigned ? _mm256_cvtepi8_epi16(bytes) : _mm256_cvtepu8_epi16(bytes);
  return reinterpret_cast<const u16x16&>(wide);
#else
  u16x16 out;
  for (int i = 0; i < 16; ++i)
    out[i] = kSigned ? static_cast<uint16_t>(static_cast<const int8_t*>(p)[i]) : static_cast<const uint8_t*>(p)[i];
  return out;
#endif
}
// 16 fp8 bytes as float16 bits: e5m2 is a float16's top byte; e4m3 sign-extended and shifted by 7
// has its sign in bits 15 and 14, exponent and mantissa below, and clearing bit 14 leaves
// e4m3_half_bits.
inline u16x16 half_bits(const fp8_e5m2* p) { return widen_bytes<false>(p) << 8; }
inline u16x16 half_bits(const fp8_e4m3* p) { return (widen_bytes<true>(p) << 7) & static_cast<uint16_t>(0xBFFF); }
inline f32x16 load16(const fp8_e5m2* p) { return half_bits_to_float(half_bits(p)); }
inline f32x16 load16(const fp8_e4m3* p) { return half_bits_to_float(half_bits(p)); }
// A bfloat16 cache element that AVX2's decode reads in "pair order": a 32-bit lane holds two
// bfloat16s, the lower one becomes a float by a shift and the upper one by a mask, so 16 elements
// arrive as their 8 even ones, then their 8 odd ones (lanes.h's load16 / lanes_load16 for it): two
// instructions for 16 where widening them in order takes four, two of them shuffles on the port the
// shifts leave free. The query and the accumulators of such a work item are kept in the same order
// (to_even_odd_order<8>, from_even_odd_order<8>); a row's last D % 16 elements stay in order (the
// tiles read them one at a time).
struct bf16_pairs {
  uint16_t bits;
};
inline float element_value(bf16_pairs x) { return static_cast<float>(c10::BFloat16(x.bits, c10::BFloat16::from_bits())); }
// An fp8 cache element (T: fp8_e4m3 or fp8_e5m2) that AVX2's decode reads in the same pair order
// (lanes.h): 16 bytes widened with their sign to 16-bit lanes, then each element put into a float32's
// sign, exponent and mantissa fields by one shift and a mask (5 instructions for 16 elements; the
// float16 route took 6 with two 2-uop conversions, and they bound the 8-bit decode on AVX2). The fp8
// exponent lands in the float32's exponent field unrebiased, so the float is the element's raw value
// (element_value of T) times 2^-112, fp8 subnormals becoming float32 subnormals with the same factor;
// the work item multiplies the query and the probabilities by kFp8PairsScale instead, so that no
// product is subnormal.
template <typename T>
struct fp8_pairs {
  uint8_t bits;
};
constexpr float kFp8PairsScale = 0x1p112f;
// Where the byte's top bit lands (the shift of the even element of a 32-bit lane) and which bits
// are kept: the sign (bit 31, a copy of it) and the exponent and mantissa (below bit 27 or 28).
template <typename T>
constexpr int kFp8PairsShift = std::is_same_v<T, fp8_e4m3> ? 20 : 21;
template <typename T>
constexpr uint32_t kFp8PairsMask = std::is_same_v<T, fp8_e4m3> ? 0x87F00000u : 0x8FE00000u;
template <typename T>
inline float element_value(fp8_pairs<T> x) {
  const uint32_t b = x.bits;
  const uint32_t bits = ((b & 0x80u) << 24) | ((b & 0x7Fu) << kFp8PairsShift<T>);
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}
// Rows whose chunks of 2K floats hold the chunk's K even elements, then its K odd ones (AVX2's pair
// order, K = 8; the AMX P.V sums, K = 16, tile_amx.h), from and to plain order; a last part shorter
// than a chunk stays as it is.
template <int K>
inline void to_even_odd_order(const float* row, int64_t D, float* out) {
  const int64_t whole = D / (2 * K) * (2 * K);
  for (int64_t c = 0; c < whole; c += 2 * K)
    for (int i = 0; i < K; ++i) out[c + i] = row[c + 2 * i], out[c + K + i] = row[c + 2 * i + 1];
  std::copy(row + whole, row + D, out + whole);
}
template <int K>
inline void from_even_odd_order(float* row, int64_t D) {
  for (int64_t c = 0; c + 2 * K <= D; c += 2 * K) {
    float chunk[2 * K];
    std::copy(row + c, row + c + 2 * K, chunk);
    for (int i = 0; i < K; ++i) row[c + 2 * i] = chunk[i], row[c + 2 * i + 1] = chunk[K + i];
  }
}

// 32 cache elements as two f32x16 (lo: the first 16). Two load16 calls, except for fp8 on AVX-512,
// where the byte widening and the bit shuffling run once on all 32 (one 512-bit instruction each
// instead of two 256-bit ones): 8 instructions for 32 e4m3 elements instead of 10, 7 for e5m2
// instead of 8, ahead of the float16 conversions, which stay two.
template <typename T>
inline void load32(const T* p, f32x16& lo, f32x16& hi) {
  lo = load16(p), hi = load16(p + 16);
}
#if defined(__AVX512BW__)
inline void half_bits_to_floats(__m512i bits, f32x16& lo, f32x16& hi) {
  const __m512 a = _mm512_cvtph_ps(_mm512_castsi512_si256(bits)), b = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(bits, 1));
  lo = reinterpret_cast<const f32x16&>(a), hi = reinterpret_cast<const f32x16&>(b);
}
inline void load32(const fp8_e5m2* p, f32x16& lo, f32x16& hi) {
  const __m512i bytes = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  half_bits_to_floats(_mm512_slli_epi16(bytes, 8), lo, hi);
}
inline void load32(const fp8_e4m3* p, f32x16& lo, f32x16& hi) {
  const __m512i bytes = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  half_bits_to_floats(_mm512_and_si512(_mm512_slli_epi16(bytes, 7), _mm512_set1_epi16(static_cast<short>(0xBFFF))), lo, hi);
}
#endif
// An 8-bit cache's scales as the kernels apply them.
struct KVScales {
  const float* key = nullptr;  // int8: one per token and kv head, at (cache row offset) / head_dim
  const float* value = nullptr;
  float key_layer = 1.f, value_layer = 1.f;  // fp8: raw_scale of the layer's scales; 1 otherwise
};

// One element as load16 gives it (the tails of rows whose length is not a multiple of 16).
template <typename T>
inline float element_value(T x) { return static_cast<float>(x); }
inline float element_value(fp8_e5m2 x) { return static_cast<float>(c10::Half(e5m2_half_bits(x.bits), c10::Half::from_bits())); }
inline float element_value(fp8_e4m3 x) { return static_cast<float>(c10::Half(e4m3_half_bits(x.bits), c10::Half::from_bits())); }

// A chunk of 2K floats accumulated by HeadTile::accumulate_bf16 or accumulate_int8 from vectors of
// K int32 lanes (16 on AVX-512, 8 on AVX2) holds, in its first K floats, elements 8L + j and in its
// last K, elements 8L + 4 + j (at 4L + j, for L < K / 4, j < 4): the 128-bit-lane interleave of
// unpacklo/hi. This puts a row of n such chunks back in order.
template <int K = 16>
inline void from_unpack_order(float* row, int64_t n) {
  float tmp[2 * K];
  for (int64_t b = 0; b < n; b += 2 * K) {
    for (int L = 0; L < K / 4; ++L)
      for (int j = 0; j < 4; ++j) tmp[8 * L + j] = row[b + 4 * L + j], tmp[8 * L + 4 + j] = row[b + K + 4 * L + j];
    std::memcpy(row + b, tmp, sizeof(tmp));
  }
}

#if defined(__AVX512F__)
// The mask of the first min(count, 16) lanes: a masked load of a row's tail reads nothing past it.
inline __mmask16 first_lanes(int64_t count) {
  return count >= 16 ? __mmask16{0xFFFF} : static_cast<__mmask16>((1u << count) - 1);
}
#endif

#if defined(__AVX512F__)
// out[0, 64) += P in unpack order (from_unpack_order's layout: columns [0, 32) as lo then hi, then
// [32, 64)), where P[k] holds columns 16L + 4k + j at lane 4L + j: the order that interleaving two
// rows byte by byte and looking the bytes up gives (fp8 P.V). Once per block, not in the hot loop.
inline void add_in_unpack_order(const __m512 (&P)[4], float* out) {
  const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i last = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  const __m512 parts[4] = {_mm512_permutex2var_ps(P[0], first, P[2]), _mm512_permutex2var_ps(P[1], first, P[3]),
                           _mm512_permutex2var_ps(P[0], last, P[2]), _mm512_permutex2var_ps(P[1], last, P[3])};
  for (int k = 0; k < 4; ++k) _mm512_storeu_ps(out + 16 * k, _mm512_add_ps(_mm512_loadu_ps(out + 16 * k), parts[k]));
}
#endif

inline void axpy(float alpha, const float* x, float* y, int64_t n) {
  int64_t i = 0;
  for (; i + kW <= n; i += kW) store(y + i, load(y + i) + alpha * load(x + i));
  for (; i < n; ++i) y[i] += alpha * x[i];
}

// ---- A tile's scores out of its accumulators (HeadTile, head_tile.h).

// Token pairs a block's packed probabilities hold in the pair dot products' P.V (blocks of at most
// 256 tokens).
constexpr int64_t kMaxPairs = 128;
// scores[g * stride + t] = scale * (q[g] . k[t]) for the n rows of k, from the per-lane
// partial sums acc[g] of one token: reduced four heads at a time.
template <int GT>
inline void store_token(const f32x16 (&acc)[GT], float scale, float* scores, int64_t stride, int64_t t) {
  for (int g = 0; g < GT; g += 4) {
    const f32x16 zero{};
    const f32x4 s = hsum4(acc[g], g + 1 < GT ? acc[g + 1] : zero, g + 2 < GT ? acc[g + 2] : zero,
                          g + 3 < GT ? acc[g + 3] : zero) * scale;
    for (int i = 0; i < 4 && g + i < GT; ++i) scores[(g + i) * stride + t] = s[i];
  }
}
// The same for four tokens of one head: reduced together, stored as one 4-float vector.
inline void store_4_tokens(f32x16 a0, f32x16 a1, f32x16 a2, f32x16 a3, float scale, float* scores) {
  const f32x4 s = hsum4(a0, a1, a2, a3) * scale;
  std::memcpy(scores, &s, sizeof(s));
}

// Online-softmax update of one head for a block of n scores: rescale the running state to the
// new max and turn the scores into exp(score - max) in place. The running sum of exponentials
// stays a 16-lane vector (summed once, at the end) so a block costs no horizontal sum.
// AVX2 runs it on 8-float vectors: GCC lowers 16-float vector code there through the stack.
#if defined(__AVX2__) && !defined(__AVX512F__)
using SoftmaxVector = f32x8;
#else
using SoftmaxVector = f32x16;
#endif
__attribute__((always_inline)) inline void softmax_update(float* s, int64_t n, float& max_score, f32x16& exp_sum,
                                                          float* acc, int64_t D) {
  // Whole vectors, the last one padded with -inf (exp gives 0 there), so a block of 8 costs one
  // vector exp rather than eight scalar ones.
  using V = SoftmaxVector;
  constexpr int64_t w = sizeof(V) / sizeof(float);
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  // Whole vectors are loaded and stored as vectors: through memcpy GCC moved them via the stack in
  // 16-byte halves, and each 32-byte reload then stalled on store forwarding (a third of an AVX2
  // decode step, in perf). Only the tail goes through a buffer.
  auto chunk = [&](int64_t t) {
    if (t + w <= n) return *reinterpret_cast<const V*>(s + t);
    float tail[w];
    std::fill(tail, tail + w, kNegInf);
    std::copy(s + t, s + n, tail);
    return *reinterpret_cast<const V*>(tail);
  };
  V vmax = chunk(0);
  for (int64_t t = w; t < n; t += w) {
    const V c = chunk(t);
    vmax = c > vmax ? c : vmax;
  }
  const float new_max = std::max(max_score, hmax(vmax));
  if (new_max != max_score) [[unlikely]] {
    // Rescales the running state; 0 on the first block. Skipped when the max did not move, the
    // common case once it has settled.
    const float rescale = std::exp(max_score - new_max);
    exp_sum *= rescale;
    for (int64_t d = 0; d < D; ++d) acc[d] *= rescale;
    max_score = new_max;
  }
  V sum{};
  for (int64_t t = 0; t < n; t += w) {
    const V e = exp_vector(chunk(t) - new_max);
    sum += e;
    if (t + w <= n) {
      *reinterpret_cast<V*>(s + t) = e;
    } else {
      float tail[w];
      *reinterpret_cast<V*>(tail) = e;
      std::copy(tail, tail + (n - t), s + t);
    }
  }
  f32x16 lanes{};  // an 8-float sum fills the first 8 lanes
  std::memcpy(&lanes, &sum, sizeof(sum));
  exp_sum += lanes;
}

}  // namespace
}  // namespace minipaged