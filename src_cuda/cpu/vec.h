// Vector helpers shared by the CPU attention kernels (kernels.cpp: decode, prefill.cpp: prefill):
// 16-float vectors, cache-dtype loads, exp, horizontal sums, the GQA head tile that streams K/V
// rows past several query rows, and the online-softmax step.
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
using u16x16 = uint16_t __attribute__((vector_size(32), aligned(2)));
using u32x16 = uint32_t __attribute__((vector_size(64)));
using f16x16 = _Float16 __attribute__((vector_size(32), aligned(2)));

inline f32x16 load(const float* p) { return *reinterpret_cast<const f32x16*>(p); }
inline void store(float* p, f32x16 v) { *reinterpret_cast<f32x16*>(p) = v; }
inline float hsum(f32x16 v) {
  f32x8 a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
            __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  f32x4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
  return (b[0] + b[2]) + (b[1] + b[3]);
}

inline float hmax(f32x16 v) {
  auto vmax = [](auto a, auto b) { return a > b ? a : b; };
  const f32x8 a = vmax(__builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7),
                       __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15));
  const f32x4 b = vmax(__builtin_shufflevector(a, a, 0, 1, 2, 3), __builtin_shufflevector(a, a, 4, 5, 6, 7));
  return std::max(std::max(b[0], b[1]), std::max(b[2], b[3]));
}

// The four horizontal sums of a, b, c, d at once: a 4x4 transpose-and-add inside each 128-bit
// lane, then the lanes added. 13 shuffles and adds instead of 4 x 9 for four hsum calls, which
// matters because a decode kernel does one per token and query head.
inline f32x4 hsum4(f32x16 a, f32x16 b, f32x16 c, f32x16 d) {
  // Per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3] and the same for c, d.
  const f32x16 ab = __builtin_shufflevector(a, b, 0, 16, 1, 17, 4, 20, 5, 21, 8, 24, 9, 25, 12, 28, 13, 29) +
                    __builtin_shufflevector(a, b, 2, 18, 3, 19, 6, 22, 7, 23, 10, 26, 11, 27, 14, 30, 15, 31);
  const f32x16 cd = __builtin_shufflevector(c, d, 0, 16, 1, 17, 4, 20, 5, 21, 8, 24, 9, 25, 12, 28, 13, 29) +
                    __builtin_shufflevector(c, d, 2, 18, 3, 19, 6, 22, 7, 23, 10, 26, 11, 27, 14, 30, 15, 31);
  // Per lane: [a, b, c, d] partial sums.
  const f32x16 abcd = __builtin_shufflevector(ab, cd, 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29) +
                      __builtin_shufflevector(ab, cd, 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31);
  const f32x8 half = __builtin_shufflevector(abcd, abcd, 0, 1, 2, 3, 4, 5, 6, 7) +
                     __builtin_shufflevector(abcd, abcd, 8, 9, 10, 11, 12, 13, 14, 15);
  return __builtin_shufflevector(half, half, 0, 1, 2, 3) + __builtin_shufflevector(half, half, 4, 5, 6, 7);
}

// exp(x) for 16 floats: x = k ln2 + r, |r| <= ln2/2, exp(r) by a degree-6 Taylor polynomial
// (relative error < 2e-7 on that range), 2^k spliced into the exponent bits. Inputs below
// -87 flush to 0, which is what the softmax wants for far-below-max scores.
inline f32x16 exp16(f32x16 x) {
  using i32x16 = int32_t __attribute__((vector_size(64)));
  const f32x16 lo = f32x16{} - 87.f;
  x = x < lo ? lo : x;
  const f32x16 k = __builtin_convertvector(__builtin_convertvector(x * 1.44269504f + (x < 0 ? -0.5f : 0.5f) , i32x16), f32x16);
  const f32x16 r = x - k * 0.693145751953125f - k * 1.428606765330187e-06f;
  f32x16 p = 1.f / 720 + f32x16{};
  p = p * r + 1.f / 120;
  p = p * r + 1.f / 24;
  p = p * r + 1.f / 6;
  p = p * r + 0.5f;
  p = p * r + 1.f;
  p = p * r + 1.f;
  const i32x16 bits = (__builtin_convertvector(k, i32x16) + 127) << 23;
  f32x16 result = p * reinterpret_cast<const f32x16&>(bits);
  return x <= lo ? f32x16{} : result;
}

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
constexpr bool kQuantized = std::is_same_v<T, int8_t> || std::is_same_v<T, fp8_e4m3> || std::is_same_v<T, fp8_e5m2>;


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
inline f32x16 load16(const fp8_e5m2* p) { return half_bits_to_float(widen_bytes<false>(p) << 8); }
inline f32x16 load16(const fp8_e4m3* p) {
  // Sign-extended and shifted by 7: the sign lands in bits 15 and 14, exponent and mantissa below;
  // clearing bit 14 leaves e4m3_half_bits.
  return half_bits_to_float((widen_bytes<true>(p) << 7) & static_cast<uint16_t>(0xBFFF));
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

// A 32-float chunk accumulated by HeadTile::accumulate_bf16 holds, in its first 16 floats,
// elements 8L + j and in its last 16, elements 8L + 4 + j (at 4L + j, for L, j < 4): the
// 128-bit-lane interleave of unpacklo/hi. This puts a row of n such chunks back in order.
inline void from_unpack_order(float* row, int64_t n) {
  float tmp[32];
  for (int64_t b = 0; b < n; b += 32) {
    for (int L = 0; L < 4; ++L)
      for (int j = 0; j < 4; ++j) tmp[8 * L + j] = row[b + 4 * L + j], tmp[8 * L + 4 + j] = row[b + 16 + 4 * L + j];
    std::memcpy(row + b, tmp, sizeof(tmp));
  }
}

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
#endif

#if defined(__AVX512F__)
// The mask of the first min(count, 16) lanes: a masked load of a row's tail reads nothing past it.
inline __mmask16 first_lanes(int64_t count) {
  return count >= 16 ? __mmask16{0xFFFF} : static_cast<__mmask16>((1u << count) - 1);
}
#endif

inline void prefetch(const char* p, int64_t bytes) {
  for (int64_t i = 0; i < bytes; i += 64) __builtin_prefetch(p + i);
}

// Lines asked for a few at a time as rows are computed: a steady trickle keeps memory busy
// without a burst that stalls the core. The stream is `rows` rows of `row_bytes`, starting at
// `at`; `left` bytes of it lie in this run, the rest at `then` (the next run; null: the stream
// stops there). upto(r) asks for the rows [done, r) not asked for yet. It is called once per
// token (or four) in the hottest loops: every field is written unconditionally and the slow path
// takes no `this`, so GCC keeps the state in registers there.
struct RowPrefetch {
  const char* at = nullptr;
  int64_t left = 0;
  const char* then = nullptr;
  int64_t row_bytes = 0, rows = 0, done = 0;

  __attribute__((always_inline)) void upto(int64_t row) {
    const int64_t more = std::max<int64_t>(std::min(row, rows) - done, 0);
    done += more;
    const int64_t bytes = more * row_bytes;
    if (bytes > left) [[unlikely]] {
      const Crossed c = cross(at, bytes, left, then);
      at = c.at, left = c.left, then = nullptr;
      return;
    }
    // One line per loop step: issuing them faster (unrolled by four, or one beside each load)
    // measured 2-9% slower from memory, though faster in cache (bench/RESULTS.md).
    prefetch(at, bytes);
    at += bytes;
    left -= bytes;
  }

  // Rows [0, rows) from `base`: one contiguous stream.
  static RowPrefetch rows_at(const char* base, int64_t row_bytes, int64_t rows) {
    return RowPrefetch{base, std::numeric_limits<int64_t>::max(), nullptr, row_bytes, rows};
  }
  // The stream `ahead` bytes past `offset` in reading order: the rest of this run (`run_bytes`
  // from `run`), then the next run (`next_run`, may be null). `rows` rows of `row_bytes`.
  static RowPrefetch ahead(const char* run, int64_t run_bytes, const char* next_run, int64_t offset, int64_t ahead,
                           int64_t row_bytes, int64_t rows) {
    const int64_t start = offset + ahead;
    if (start < run_bytes) return RowPrefetch{run + start, run_bytes - start, next_run, row_bytes, rows};
    if (next_run == nullptr) return RowPrefetch{};
    return rows_at(next_run + (start - run_bytes), row_bytes, rows);
  }

 private:
  struct Crossed {
    const char* at;
    int64_t left;
  };
  // The slow path of upto: `bytes` from `at` run past this run's `left` bytes, into `then`.
  __attribute__((noinline)) static Crossed cross(const char* at, int64_t bytes, int64_t left, const char* then) {
    prefetch(at, left);
    if (then == nullptr) return {at + left, 0};  // the stream stops here
    prefetch(then, bytes - left);
    return {then + (bytes - left), std::numeric_limits<int64_t>::max()};
  }
};

inline void axpy(float alpha, const float* x, float* y, int64_t n) {
  int64_t i = 0;
  for (; i + kW <= n; i += kW) store(y + i, load(y + i) + alpha * load(x + i));
  for (; i < n; ++i) y[i] += alpha * x[i];
}

// A tile of GT query heads of one GQA group, kept in registers while a block streams by:
// each K/V row is loaded once for all GT heads.
template <int GT>
struct HeadTile {
  // Token pairs a block's packed probabilities hold in the pair dot products' P.V (blocks of at most
  // 256 tokens).
  static constexpr int64_t kMaxPairs = 128;
  // scores[g * stride + t] = scale * (q[g] . k[t]) for the n rows of k, from the per-lane
  // partial sums acc[g] of one token: reduced four heads at a time.
  static void store_token(const f32x16 (&acc)[GT], float scale, float* scores, int64_t stride, int64_t t) {
    for (int g = 0; g < GT; g += 4) {
      const f32x16 zero{};
      const f32x4 s = hsum4(acc[g], g + 1 < GT ? acc[g + 1] : zero, g + 2 < GT ? acc[g + 2] : zero,
                            g + 3 < GT ? acc[g + 3] : zero) * scale;
      for (int i = 0; i < 4 && g + i < GT; ++i) scores[(g + i) * stride + t] = s[i];
    }
  }
  // The same for four tokens of one head: reduced together, stored as one 4-float vector.
  static void store_4_tokens(f32x16 a0, f32x16 a1, f32x16 a2, f32x16 a3, float scale, float* scores) {
    const f32x4 s = hsum4(a0, a1, a2, a3) * scale;
    std::memcpy(scores, &s, sizeof(s));
  }

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
#if defined(__AVX512BF16__)
  // bfloat16 Q.K with the hardware's bf16 pair dot product (products exact, float32 sums): the
  // query stays in bfloat16 (it is bfloat16 already) and the scale is applied to the scores.
  static void scores_bf16(const c10::BFloat16* q, float scale, const c10::BFloat16* k, int64_t n, int64_t D,
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
          for (int c = 0; c < 4; ++c)
            for (int i = 0; i < 4; ++i) {
              const __m512bh kv = (__m512bh)_mm512_loadu_si512(k + (t + i) * D + c * 32);
              for (int g = 0; g < GT; ++g) a[i][g] = _mm512_dpbf16_ps(a[i][g], qv[g][c], kv);
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
      for (int64_t d = 0; d < D; d += 32) {
        const __m512bh kv = (__m512bh)_mm512_loadu_si512(k + t * D + d);
        for (int g = 0; g < GT; ++g)
          a[g] = _mm512_dpbf16_ps(a[g], (__m512bh)_mm512_loadu_si512(q + g * D + d), kv);
      }
      f32x16 acc[GT];
      for (int g = 0; g < GT; ++g) acc[g] = as_f32x16(a[g]);
      store_token(acc, scale, scores, stride, t);
    }
  }
  // tokens_by_four with the pair dot product. DC = head_dim / 32.
  template <int DC>
  static int64_t tokens_by_four_bf16(const c10::BFloat16* q, float scale, const c10::BFloat16* k, int64_t n,
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
  template <int DC, int H>
  static void four_tokens_bf16(const c10::BFloat16* q, float scale, const c10::BFloat16* k, float* scores,
                               int64_t stride) {
    constexpr int64_t D = DC * 32;
    __m512 a[4][H];
    auto chunk = [&](int c, auto first) __attribute__((always_inline)) {
      __m512bh qv[H];
      for (int h = 0; h < H; ++h) qv[h] = (__m512bh)_mm512_loadu_si512(q + h * D + c * 32);
      for (int i = 0; i < 4; ++i) {
        const __m512bh kv = (__m512bh)_mm512_loadu_si512(k + i * D + c * 32);
        for (int h = 0; h < H; ++h) a[i][h] = _mm512_dpbf16_ps(first ? _mm512_setzero_ps() : a[i][h], qv[h], kv);
      }
    };
    chunk(0, std::true_type{});
    for (int c = 1; c < DC; ++c) chunk(c, std::false_type{});
    auto as_f32x16 = [](__m512 v) { return reinterpret_cast<const f32x16&>(v); };
    for (int h = 0; h < H; ++h)
      store_4_tokens(as_f32x16(a[0][h]), as_f32x16(a[1][h]), as_f32x16(a[2][h]), as_f32x16(a[3][h]), scale,
                     scores + h * stride);
  }
  // acc[g] += sum_t p[g][t] * v[t] with the same pair dot product, two tokens per instruction:
  // rows t and t+1 are interleaved (unpacklo/hi), so the accumulators hold each 32-element chunk
  // in "unpack order" (see from_unpack_order). The probabilities are rounded to bfloat16 for this
  // product, as FlashAttention does for P.V; the softmax itself stays float32. n <= 256.
  static void accumulate_bf16(const float* p, int64_t stride, const c10::BFloat16* v, int64_t n, int64_t D,
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
    for (; d + C * 32 <= D; d += C * 32) accumulate_bf16_panel<C>(packed, v, n, D, acc + d, d, pf);
    for (; d < D; d += 32) accumulate_bf16_panel<1>(packed, v, n, D, acc + d, d, pf);
    pf.upto(pf.rows);
  }
  // acc[g][0, 32 C) (row stride D) += the pairs' products over v's columns [d, d + 32 C). The first
  // panel also trickles out the prefetch (pf), a row pair at a time.
  template <int C>
  static void accumulate_bf16_panel(const uint32_t (*packed)[kMaxPairs], const c10::BFloat16* v, int64_t n, int64_t D,
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
#pragma GCC unroll 8
      for (int g = 0; g < GT; ++g) pp[g] = (__m512bh)_mm512_set1_epi32(static_cast<int>(packed[g][i]));
#pragma GCC unroll 4
      for (int c = 0; c < C; ++c) {
        const __m512i a = _mm512_loadu_si512(v + 2 * i * D + c * 32);
        const __m512i b = 2 * i + 1 < n ? _mm512_loadu_si512(v + (2 * i + 1) * D + c * 32) : _mm512_setzero_si512();
        const __m512bh lo = (__m512bh)_mm512_unpacklo_epi16(a, b), hi = (__m512bh)_mm512_unpackhi_epi16(a, b);
#pragma GCC unroll 8
        for (int g = 0; g < GT; ++g) {
          lo_acc[g][c] = _mm512_dpbf16_ps(lo_acc[g][c], lo, pp[g]);
          hi_acc[g][c] = _mm512_dpbf16_ps(hi_acc[g][c], hi, pp[g]);
        }
      }
    }
#pragma GCC unroll 8
    for (int g = 0; g < GT; ++g)
#pragma GCC unroll 4
      for (int c = 0; c < C; ++c)
        _mm512_storeu_ps(acc + g * D + c * 32, lo_acc[g][c]), _mm512_storeu_ps(acc + g * D + c * 32 + 16, hi_acc[g][c]);
  }
#endif
#if defined(__AVX512VNNI__)
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
    for (int h = 0; h < H; ++h) {
      const f32x4 s = hsum4(as_float(a[0][h]), as_float(a[1][h]), as_float(a[2][h]), as_float(a[3][h])) *
                      (token_scales * q_scale[h]);
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
#endif
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

constexpr int64_t kMaxTile = 8;

// Calls f(HeadTile<gt>{}) for a run-time gt in [1, kMaxTile].
template <typename F>
void with_tile(int64_t gt, F&& f) {
  switch (gt) {
    case 1: return f(HeadTile<1>{});
    case 2: return f(HeadTile<2>{});
    case 3: return f(HeadTile<3>{});
    case 4: return f(HeadTile<4>{});
    case 5: return f(HeadTile<5>{});
    case 6: return f(HeadTile<6>{});
    case 7: return f(HeadTile<7>{});
    default: return f(HeadTile<8>{});
  }
}

// Online-softmax update of one head for a block of n scores: rescale the running state to the
// new max and turn the scores into exp(score - max) in place. The running sum of exponentials
// stays a 16-lane vector (summed once, at the end) so a block costs no horizontal sum.
__attribute__((always_inline)) inline void softmax_update(float* s, int64_t n, float& max_score, f32x16& exp_sum,
                                                          float* acc, int64_t D) {
  // Whole 16-score vectors, the last one padded with -inf (exp gives 0 there), so a block of
  // 8 costs one vector exp rather than eight scalar ones.
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  auto chunk = [&](int64_t t) {
    if (t + kW <= n) return load(s + t);
    f32x16 v = f32x16{} + kNegInf;
    std::memcpy(&v, s + t, (n - t) * sizeof(float));
    return v;
  };
  f32x16 vmax = chunk(0);
  for (int64_t t = kW; t < n; t += kW) {
    const f32x16 c = chunk(t);
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
  for (int64_t t = 0; t < n; t += kW) {
    const f32x16 e = exp16(chunk(t) - new_max);
    exp_sum += e;
    if (t + kW <= n) store(s + t, e);
    else std::memcpy(s + t, &e, (n - t) * sizeof(float));
  }
}

}  // namespace
}  // namespace minipaged
