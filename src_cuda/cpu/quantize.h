// The CPU write of an 8-bit cache (quant.h): reshape_and_cache's quantizing half. Compiled once
// (not per instruction set): it is a small part of a write's time, which the copy of the bytes
// and the scattered stores dominate.
#pragma once
#include <ATen/core/Tensor.h>

#include "cache_layout.h"
#include "checks.h"
#include "quant.h"

namespace minipaged::cpu {

// Quantizes key[i] / value[i] into slot slot(i) of the caches (negative: skipped). int8 writes
// the rows' scales into key_scale / value_scale; fp8 applies the layer scales given.
void quantize_and_cache(const at::Tensor& key, const at::Tensor& value, at::Tensor& key_cache, at::Tensor& value_cache,
                        const HostInts& slot, const CacheLayout& layout, KVFormat format, float* key_scales,
                        float* value_scales, float key_layer_scale, float value_layer_scale);

}  // namespace minipaged::cpu
