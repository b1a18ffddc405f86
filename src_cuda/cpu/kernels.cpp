// CPU kernels. Decode attention is memory-bound, so the plan is to read every K/V byte once:
// work items are (sequence, partition of the context) and walk each block front to back over
// its kv heads, all query heads of a GQA group are handled together, and a softmax that is
// online across chunks of blocks keeps one pass over K/V.
// Partitions let a single long sequence use every core; their partial results are merged
// afterwards with the usual (max, sum) rescaling.
// Compiled once per instruction set (cpu/isa.h): everything here lives in
// minipaged::<variant>, and `#if defined(__AVX512BF16__)` etc. select per copy.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <type_traits>
#include <vector>

#include "cache_layout.h"
#include "checks.h"
#include "cpu/decode_item.h"
#include "cpu/head_tile.h"
#include "cpu/isa.h"
#include "cpu/quantize.h"
#include "cpu/row_prefetch.h"
#include "cpu/vec.h"

namespace minipaged::MINIPAGED_CPU_ISA {
namespace {

constexpr int64_t kPartitionTokens = 512;  // most tokens per work item along the context

at::Tensor paged_attention_decode_cpu(const at::Tensor& query, const at::Tensor& key_cache,
                                      const at::Tensor& value_cache, const at::Tensor& block_tables,
                                      const at::Tensor& seq_lens, double scale,
                                      std::optional<int64_t> max_seq_len, const std::optional<at::Tensor>& key_scale,
                                      const std::optional<at::Tensor>& value_scale) {
  const CacheLayout layout = check_paged_attention_decode(query, key_cache, value_cache, block_tables, seq_lens);
  const KVFormat format = check_kv_scales(key_cache, layout, key_scale, value_scale);
  const LayerScales layer = check_layer_scale_values(format, key_scale, value_scale);
  check_decode_ranges(block_tables, seq_lens, layout);
  KVScales kv_scales{nullptr, nullptr, raw_scale(format, layer.key), raw_scale(format, layer.value)};
  if (format == KVFormat::kInt8) kv_scales.key = key_scale->const_data_ptr<float>(), kv_scales.value = value_scale->const_data_ptr<float>();
  const at::Tensor lens = seq_lens.contiguous();
  const int32_t* lens_ptr = lens.data_ptr<int32_t>();
  const int64_t num_seqs = query.size(0), num_heads = query.size(1), D = layout.head_dim;
  const int64_t group = num_heads / layout.num_kv_heads;
  int64_t longest = 0;
  for (int64_t s = 0; s < num_seqs; ++s) longest = std::max<int64_t>(longest, lens_ptr[s]);
  if (max_seq_len.has_value())
    TORCH_CHECK_VALUE(longest <= *max_seq_len, "max_seq_len: ", *max_seq_len,
                      " is smaller than the longest sequence in seq_lens (", longest, ")");

  // Work items are (sequence, partition of whole blocks). Partitions are at most 512 tokens,
  // and shorter when there are too few items to keep every thread busy.
  const int64_t B = layout.block_size;
  const int64_t wanted_parts = (4 * at::get_num_threads() + num_seqs - 1) / std::max<int64_t>(num_seqs, 1);
  const int64_t part_cap = std::max<int64_t>(1, kPartitionTokens / B) * B;
  const int64_t part = std::clamp<int64_t>((longest / std::max<int64_t>(wanted_parts, 1) + B - 1) / B * B, B, part_cap);
  const int64_t num_parts = std::max<int64_t>(1, (longest + part - 1) / part);
  const at::Tensor q_raw = query.contiguous();
  const at::Tensor tables = block_tables.contiguous();
  // Partials of partitioned sequences only; a sequence in one partition is written directly.
  const int64_t stored_parts = num_parts > 1 ? num_parts : 0;
  // One buffer for the partials' max scores, exponential sums and accumulators ([num_seqs,
  // num_heads, stored_parts] each, the last times head_dim): each allocation is a dispatcher
  // call, tens of microseconds with cold caches.
  const int64_t num_partials = num_seqs * num_heads * stored_parts;
  at::Tensor partials = at::empty({num_partials * (2 + D)}, query.options().dtype(at::kFloat));
  at::Tensor out = at::empty({num_seqs, num_heads, D}, query.options());

  MINIPAGED_DISPATCH(query.scalar_type(), "paged_attention_decode_cpu", [&] {
    const scalar_t* qp = q_raw.const_data_ptr<scalar_t>();
    // The work item by cache format: the query is float from here on, so an 8-bit format's
    // kernel is compiled once, whatever the query dtype.
    auto work_item = [&](const float* q, const scalar_t* q_seq, const int32_t* block_table, int64_t begin, int64_t end,
                         Partial partial, std::vector<float>& scratch) {
      auto run = [&](auto* cache_type) {
        using T = std::remove_const_t<std::remove_pointer_t<decltype(cache_type)>>;
        const c10::BFloat16* q_bf16 = nullptr;
        if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) q_bf16 = q_seq;
        decode_work_item<T>(q, q_bf16, static_cast<float>(scale), static_cast<const T*>(key_cache.const_data_ptr()),
                            static_cast<const T*>(value_cache.const_data_ptr()), layout, block_table, begin, end,
                            group, partial, scratch, kv_scales, !std::is_same_v<scalar_t, float>);
      };
      switch (format) {
        case KVFormat::kInt8: return run(static_cast<const int8_t*>(nullptr));
        case KVFormat::kFp8E4M3: return run(static_cast<const fp8_e4m3*>(nullptr));
        case KVFormat::kFp8E5M2: return run(static_cast<const fp8_e5m2*>(nullptr));
        default: return run(static_cast<const scalar_t*>(nullptr));
      }
    };
    float* mp = partials.data_ptr<float>();
    float* ep = mp + num_partials;
    float* ap = ep + num_partials;
    scalar_t* op = out.data_ptr<scalar_t>();
    const int64_t items = num_seqs * num_parts;
    // Work items are handed out one at a time from a shared counter rather than in fixed
    // slices: ragged sequences, and a core the OS takes away for a moment, then cost only
    // one item of imbalance instead of a whole slice.
    std::atomic<int64_t> next_item{0};
    // Partitions of each sequence finished so far: whoever finishes the last one merges them,
    // inside the same parallel region. A second region (a second wake-up and barrier) costs
    // little on a quiet machine but a whole time slice when another process holds a core.
    std::unique_ptr<std::atomic<int32_t>[]> parts_done(new std::atomic<int32_t>[num_seqs]());
    // Normalises (max, sum, acc) partials into the output rows of sequence s: rescaled to the
    // common max when there are several.
    auto write_output = [&](int64_t s, const float* m, const float* l, const float* a, int64_t parts,
                            std::vector<float>& row) {
      for (int64_t h = 0; h < num_heads; ++h) {
        const float* mh = m + h * parts;
        const float* lh = l + h * parts;
        const float global_max = *std::max_element(mh, mh + parts);
        std::fill(row.begin(), row.end(), 0.f);
        float total = 0.f;
        for (int64_t p = 0; p < parts; ++p) {
          if (lh[p] == 0.f) continue;
          const float w = parts == 1 ? 1.f : std::exp(mh[p] - global_max);
          total += w * lh[p];
          axpy(w, a + (h * parts + p) * D, row.data(), D);
        }
        const float inv = total > 0.f ? 1.f / total : 0.f;
        scalar_t* o = op + (s * num_heads + h) * D;
        for (int64_t d = 0; d < D; ++d) o[d] = static_cast<scalar_t>(row[d] * inv);
      }
    };
    // Below ~256 KiB of K/V (tens of microseconds on one core) waking a second thread costs
    // more than it saves, and under load it can cost a time slice: run on the caller.
    int64_t total_tokens = 0;
    for (int64_t s = 0; s < num_seqs; ++s) total_tokens += lens_ptr[s];
    const int64_t kv_bytes = 2 * total_tokens * layout.num_kv_heads * D * key_cache.element_size();
    const int64_t threads = kv_bytes < (256 << 10) ? 1 : std::min<int64_t>(items, at::get_num_threads());
    at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
      // The work items' scratch (~40-100 KiB) stays with the thread: allocated per call, it was
      // given back to the OS and faulted in again on every call.
      thread_local std::vector<float> scratch;
      std::vector<float> q(num_heads * D), m(num_heads), l(num_heads), a(num_heads * D), row(D);
      for (int64_t item; (item = next_item.fetch_add(1, std::memory_order_relaxed)) < items;) {
        const int64_t s = item / num_parts, p = item % num_parts;
        const int64_t begin = p * part, end = std::min<int64_t>(lens_ptr[s], begin + part);
        if (begin < end) {
          const scalar_t* q_seq = qp + s * num_heads * D;
          // An fp8 layer's K scale is folded in here (1 for other caches).
          const float q_scale = static_cast<float>(scale) * kv_scales.key_layer;
          for (int64_t i = 0; i < num_heads * D; ++i) q[i] = static_cast<float>(q_seq[i]) * q_scale;
          work_item(q.data(), q_seq, tables.const_data_ptr<int32_t>() + s * tables.size(1), begin, end,
                    Partial{m.data(), l.data(), a.data()}, scratch);
        } else {
          std::fill(l.begin(), l.end(), 0.f);  // an empty sequence's output is zeros
          std::fill(m.begin(), m.end(), -std::numeric_limits<float>::infinity());
        }
        if (num_parts == 1) {
          write_output(s, m.data(), l.data(), a.data(), 1, row);
          continue;
        }
        for (int64_t h = 0; h < num_heads; ++h) {
          const int64_t idx = (s * num_heads + h) * num_parts + p;
          mp[idx] = m[h];
          ep[idx] = l[h];
          if (begin < end) std::memcpy(ap + idx * D, a.data() + h * D, D * sizeof(float));
        }
        // acq_rel: the last finisher sees every other partition's partial of this sequence.
        if (parts_done[s].fetch_add(1, std::memory_order_acq_rel) + 1 == num_parts)
          write_output(s, mp + s * num_heads * num_parts, ep + s * num_heads * num_parts,
                       ap + s * num_heads * num_parts * D, num_parts, row);
      }
    });
  });
  return out;
}

// A cache write of more than this many bytes (K and V together) goes around the cache:
// streaming stores skip reading each destination line before overwriting it (the "read for
// ownership" that made a scattered 4,096-token write 0.4-0.75 of a plain copy; 0.88-1.06 with
// them, bench/RESULTS.md), as glibc's memcpy does for large copies. Smaller writes, a decode
// step's, stay cached. A prefill chunk past the limit is then read back from memory by its
// attention, ~30 us per MiB, small beside that attention's compute. A constant, not the
// last-level cache size: a VM reports its host's (384 MiB on the 32 MiB machine measured).
constexpr int64_t kStreamingWriteBytes = int64_t{1} << 20;  // tests/test_reshape_and_cache.py goes past it

// One cache row, with streaming stores when asked and the destination allows (64-byte
// aligned, whole 64-byte lines); callers end with stream_fence().
inline void copy_row(char* to, const char* from, int64_t bytes, bool streaming) {
#if defined(__AVX512F__)
  if (streaming && bytes % 64 == 0 && reinterpret_cast<uintptr_t>(to) % 64 == 0) {
    for (int64_t b = 0; b < bytes; b += 64)
      _mm512_stream_si512(reinterpret_cast<__m512i*>(to + b), _mm512_loadu_si512(from + b));
    return;
  }
#elif defined(__AVX2__)
  if (streaming && bytes % 32 == 0 && reinterpret_cast<uintptr_t>(to) % 32 == 0) {
    for (int64_t b = 0; b < bytes; b += 32)
      _mm256_stream_si256(reinterpret_cast<__m256i*>(to + b),
                          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(from + b)));
    return;
  }
#endif
  if (bytes % 64 == 0) {  // inline 64-byte moves: a library memcpy call costs as much as a short row
    for (int64_t b = 0; b < bytes; b += 64) __builtin_memcpy(to + b, from + b, 64);
    return;
  }
  std::memcpy(to, from, bytes);
}

// Streaming stores are weakly ordered: each thread fences before the op returns, so whoever
// reads the cache next sees them.
inline void stream_fence() {
#if defined(__x86_64__)
  _mm_sfence();
#endif
}

void reshape_and_cache_cpu(const at::Tensor& key, const at::Tensor& value, at::Tensor& key_cache,
                           at::Tensor& value_cache, const at::Tensor& slot_mapping,
                           const std::optional<at::Tensor>& key_scale, const std::optional<at::Tensor>& value_scale) {
  const CacheLayout layout = check_reshape_and_cache(key, value, key_cache, value_cache, slot_mapping);
  const KVFormat format = check_kv_scales(key_cache, layout, key_scale, value_scale);
  const LayerScales layer = check_layer_scale_values(format, key_scale, value_scale);
  check_slot_range(slot_mapping, layout);
  const HostInts slot(slot_mapping);
  const int64_t D = layout.head_dim;
  if (format != KVFormat::kNone) {
    const bool per_token = format == KVFormat::kInt8;
    return cpu::quantize_and_cache(key, value, key_cache, value_cache, slot, layout, format,
                                   per_token ? key_scale->data_ptr<float>() : nullptr,
                                   per_token ? value_scale->data_ptr<float>() : nullptr, layer.key, layer.value);
  }
  MINIPAGED_DISPATCH(key.scalar_type(), "reshape_and_cache_cpu", [&] {
    // One token's rows for every kv head; pointers and strides are read once, outside the loop.
    struct Source {
      const scalar_t* data;
      int64_t token_stride, head_stride, dim_stride;
    };
    const Source sources[2] = {{key.const_data_ptr<scalar_t>(), key.stride(0), key.stride(1), key.stride(2)},
                               {value.const_data_ptr<scalar_t>(), value.stride(0), value.stride(1), value.stride(2)}};
    const int64_t written = 2 * slot_mapping.size(0) * layout.num_kv_heads * D * static_cast<int64_t>(sizeof(scalar_t));
    const bool streaming = written > kStreamingWriteBytes;
    const int64_t head_stride = layout.block_size * D;  // between one slot's rows of two kv heads
    auto write = [&](const Source& src, scalar_t* dst_base, int64_t i) {
      scalar_t* const first_row = dst_base + layout.slot_row(slot(i), 0);  // one division per token
      for (int64_t h = 0; h < layout.num_kv_heads; ++h) {
        const scalar_t* from = src.data + i * src.token_stride + h * src.head_stride;
        scalar_t* to = first_row + h * head_stride;
        if (src.dim_stride == 1) {
          copy_row(reinterpret_cast<char*>(to), reinterpret_cast<const char*>(from), D * sizeof(scalar_t), streaming);
        } else {
          for (int64_t d = 0; d < D; ++d) to[d] = from[d * src.dim_stride];
        }
      }
    };
    scalar_t* kc = key_cache.data_ptr<scalar_t>();
    scalar_t* vc = value_cache.data_ptr<scalar_t>();
    at::parallel_for(0, key.size(0), 64, [&](int64_t lo, int64_t hi) {
      for (int64_t i = lo; i < hi; ++i) {
        if (slot(i) < 0) continue;
        write(sources[0], kc, i);
        write(sources[1], vc, i);
      }
      if (streaming) stream_fence();
    });
  });
}

void copy_blocks_cpu(at::Tensor& key_cache, at::Tensor& value_cache, const at::Tensor& block_mapping,
                     const std::optional<at::Tensor>& key_scale, const std::optional<at::Tensor>& value_scale) {
  const CacheLayout layout = check_copy_blocks(key_cache, value_cache, block_mapping);
  const KVFormat format = check_kv_scales(key_cache, layout, key_scale, value_scale);
  check_copy_ranges(block_mapping, layout);
  const at::Tensor pairs = block_mapping.contiguous();
  const int64_t* p = pairs.const_data_ptr<int64_t>();
  const int64_t bytes = layout.block_elems() * key_cache.element_size();
  auto* kc = static_cast<char*>(key_cache.data_ptr());
  auto* vc = static_cast<char*>(value_cache.data_ptr());
  // int8: the blocks' scales travel with their bytes (an fp8 layer's scales stay where they are).
  const bool per_token = format == KVFormat::kInt8;
  const int64_t scale_bytes = layout.num_kv_heads * layout.block_size * static_cast<int64_t>(sizeof(float));
  auto* ks = per_token ? static_cast<char*>(key_scale->data_ptr()) : nullptr;
  auto* vs = per_token ? static_cast<char*>(value_scale->data_ptr()) : nullptr;
  at::parallel_for(0, pairs.size(0), 1, [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) {
      const int64_t src = p[2 * i], dst = p[2 * i + 1];
      std::memcpy(kc + dst * bytes, kc + src * bytes, bytes);
      std::memcpy(vc + dst * bytes, vc + src * bytes, bytes);
      if (per_token) {
        std::memcpy(ks + dst * scale_bytes, ks + src * scale_bytes, scale_bytes);
        std::memcpy(vs + dst * scale_bytes, vs + src * scale_bytes, scale_bytes);
      }
    }
  });
}

}  // namespace

MINIPAGED_CPU_IMPL(m) {
  m.impl("reshape_and_cache", &reshape_and_cache_cpu);
  m.impl("paged_attention_decode", &paged_attention_decode_cpu);
  m.impl("copy_blocks", &copy_blocks_cpu);
}

}  // namespace minipaged::MINIPAGED_CPU_ISA
