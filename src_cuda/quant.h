// The 8-bit KV cache formats, in one place for the CPU and CUDA kernels and the checks.
//
//   int8      symmetric, one float32 scale per token and kv head, set when the token is written:
//             scale = amax / 127, q = round_half_even(x * (127 / amax)) (amax = 0: q = 0, scale 0).
//             The scales lie beside the cache as [num_blocks, num_kv_heads, block_size] float32,
//             paged like the cache, so that index row / head_dim of a cache row is its scale.
//   fp8_e4m3  float8_e4m3fn (max 448) and float8_e5m2 (max 57344) with one float32 scale per layer
//   fp8_e5m2  for K and one for V: q = fp8(saturate(x * (1 / scale))), round half to even.
// Dequantized: x = q * scale. The quantizers below are the reference's bit for bit (float32 ops
// only, no contraction), so the tests compare the bytes exactly.
#pragma once
#include <cstdint>
#include <cstring>

#include "cache_layout.h"  // MINIPAGED_HOST_DEVICE

#if defined(__CUDACC__)
#define MINIPAGED_RINTF(x) rintf(x)
#else
#include <cmath>
#define MINIPAGED_RINTF(x) std::nearbyint(x)
#endif

namespace minipaged {

enum class KVFormat : int { kNone = 0, kInt8 = 1, kFp8E4M3 = 2, kFp8E5M2 = 3 };

constexpr float kInt8Max = 127.f;
constexpr float kFp8E4M3Max = 448.f;
constexpr float kFp8E5M2Max = 57344.f;

// One-byte storage types of the fp8 formats (int8 is int8_t).
struct fp8_e4m3 {
  uint8_t bits;
};
struct fp8_e5m2 {
  uint8_t bits;
};

MINIPAGED_HOST_DEVICE uint32_t float_bits(float x) {
  uint32_t u;
  memcpy(&u, &x, sizeof(u));
  return u;
}

// round_half_even(x * inv_scale) in [-127, 127].
MINIPAGED_HOST_DEVICE int8_t quantize_int8(float x, float inv_scale) {
  float v = x * inv_scale;
  v = v > kInt8Max ? kInt8Max : (v < -kInt8Max ? -kInt8Max : v);
  return static_cast<int8_t>(MINIPAGED_RINTF(v));
}

// x to an fp8 format with MANT mantissa bits and exponent bias BIAS, round half to even,
// saturated to +-max_value; NaN stays NaN.
template <int MANT, int BIAS>
MINIPAGED_HOST_DEVICE uint8_t float_to_fp8(float x, float max_value, uint8_t max_bits, uint8_t nan_bits) {
  const uint32_t u = float_bits(x);
  const uint8_t sign = static_cast<uint8_t>((u >> 24) & 0x80);
  const float a = x < 0.f ? -x : x;
  if (!(a == a)) return sign | nan_bits;
  if (a >= max_value) return sign | max_bits;
  // Below the smallest normal (2^(1 - BIAS)): multiples of 2^(1 - BIAS - MANT), rounded to even.
  const float min_normal = 1.f / static_cast<float>(1u << (BIAS - 1));
  if (a < min_normal) {
    const float steps = a * static_cast<float>(1u << (BIAS - 1 + MANT));  // exact: a power of two
    return sign | static_cast<uint8_t>(MINIPAGED_RINTF(steps));  // 2^MANT steps is the smallest normal
  }
  uint32_t ua = float_bits(a);
  constexpr int kDrop = 23 - MANT;
  ua += ((1u << (kDrop - 1)) - 1) + ((ua >> kDrop) & 1);  // round half to even at the kept mantissa
  const uint32_t exponent = (ua >> 23) - 127 + BIAS;
  return sign | static_cast<uint8_t>((exponent << MANT) | ((ua >> kDrop) & ((1u << MANT) - 1)));
}

MINIPAGED_HOST_DEVICE fp8_e4m3 quantize_e4m3(float x, float inv_scale) {
  return fp8_e4m3{float_to_fp8<3, 7>(x * inv_scale, kFp8E4M3Max, 0x7e, 0x7f)};
}
MINIPAGED_HOST_DEVICE fp8_e5m2 quantize_e5m2(float x, float inv_scale) {
  return fp8_e5m2{float_to_fp8<2, 15>(x * inv_scale, kFp8E5M2Max, 0x7b, 0x7f)};
}

// The bits of a float16 whose value is the fp8 byte's value times kRawFactor:
//   e5m2 is the top byte of a float16 (kRawFactor 1, NaN and inf kept);
//   e4m3 moved into a float16's exponent and mantissa fields reads as value * 2^-8 for normals and
//   subnormals alike (the biases differ by 8; kRawFactor 2^-8). Its NaN (0x7f) reads as 480 * 2^-8:
//   a NaN written to an e4m3 cache does not read back as NaN.
// The kernels multiply by the scale / kRawFactor, folded into the per-layer scale.
MINIPAGED_HOST_DEVICE uint16_t e5m2_half_bits(uint8_t b) { return static_cast<uint16_t>(b << 8); }
MINIPAGED_HOST_DEVICE uint16_t e4m3_half_bits(uint8_t b) {
  return static_cast<uint16_t>(((b & 0x80) << 8) | ((b & 0x7f) << 7));
}
constexpr float kE4M3RawFactor = 1.f / 256.f;

// The per-layer scale the kernels apply to a "raw" element (see above): scale / kRawFactor.
MINIPAGED_HOST_DEVICE float raw_scale(KVFormat format, float scale) {
  return format == KVFormat::kFp8E4M3 ? scale * 256.f : scale;
}

}  // namespace minipaged
