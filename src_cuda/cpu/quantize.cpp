#include "cpu/quantize.h"

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <vector>

namespace minipaged::cpu {

// One (token, kv head) row of floats into `to` (the cache row), and its scale for int8.
static void quantize_row(const float* row, int64_t D, KVFormat format, void* to, float* scale, float inv_layer) {
  switch (format) {
    case KVFormat::kInt8: {
      float amax = 0.f;
      for (int64_t d = 0; d < D; ++d) amax = std::max(amax, std::fabs(row[d]));
      const float inv = amax > 0.f ? std::min(kInt8Max / amax, FLT_MAX) : 0.f;
      *scale = amax / kInt8Max;
      auto* out = static_cast<int8_t*>(to);
      for (int64_t d = 0; d < D; ++d) out[d] = quantize_int8(row[d], inv);
      return;
    }
    case KVFormat::kFp8E4M3: {
      auto* out = static_cast<fp8_e4m3*>(to);
      for (int64_t d = 0; d < D; ++d) out[d] = quantize_e4m3(row[d], inv_layer);
      return;
    }
    case KVFormat::kFp8E5M2: {
      auto* out = static_cast<fp8_e5m2*>(to);
      for (int64_t d = 0; d < D; ++d) out[d] = quantize_e5m2(row[d], inv_layer);
      return;
    }
    case KVFormat::kNone: return;
  }
}

void quantize_and_cache(const at::Tensor& key, const at::Tensor& value, at::Tensor& key_cache, at::Tensor& value_cache,
                        const HostInts& slot, const CacheLayout& layout, KVFormat format, float* key_scales,
                        float* value_scales, float key_layer_scale, float value_layer_scale) {
  const int64_t D = layout.head_dim;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, key.scalar_type(), "quantize_and_cache", [&] {
    struct Side {
      const scalar_t* data;
      int64_t token_stride, head_stride, dim_stride;
      uint8_t* cache;
      float* scales;
      float inv_layer;  // 1 / the fp8 layer scale, in float32 as the reference computes it
    };
    const Side sides[2] = {
        {key.const_data_ptr<scalar_t>(), key.stride(0), key.stride(1), key.stride(2),
         static_cast<uint8_t*>(key_cache.data_ptr()), key_scales, 1.f / key_layer_scale},
        {value.const_data_ptr<scalar_t>(), value.stride(0), value.stride(1), value.stride(2),
         static_cast<uint8_t*>(value_cache.data_ptr()), value_scales, 1.f / value_layer_scale}};
    at::parallel_for(0, key.size(0), 16, [&](int64_t lo, int64_t hi) {
      std::vector<float> row(D);
      for (int64_t i = lo; i < hi; ++i) {
        const int64_t s = slot(i);
        if (s < 0) continue;
        for (const Side& side : sides)
          for (int64_t h = 0; h < layout.num_kv_heads; ++h) {
            const scalar_t* from = side.data + i * side.token_stride + h * side.head_stride;
            for (int64_t d = 0; d < D; ++d) row[d] = static_cast<float>(from[d * side.dim_stride]);
            const int64_t at = layout.slot_row(s, h);  // bytes: one per element
            quantize_row(row.data(), D, format, side.cache + at, side.scales == nullptr ? nullptr : side.scales + at / D,
                         side.inv_layer);
          }
      }
    });
  });
}

}  // namespace minipaged::cpu
