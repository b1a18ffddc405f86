// A prefill work item (a tile of query rows of one kv head, see prefill.cpp), its per-thread
// scratch, and the lane path (AVX-512 and AVX2; microkernels in lane_kernels.h, vector in lanes.h)
// that runs an item with the query rows along the vector lanes where it can (head_dim 64, 128 or
// 256 and at least kLanes rows);
// prefill.cpp has the generic path and the op. Included only by prefill.cpp, once per instruction-set object (cpu/isa.h).
#pragma once

#include <cstdint>
#include <type_traits>
#include <vector>

#include "cache_layout.h"
#include "cpu/isa.h"
#include "cpu/lane_kernels.h"
#include "cpu/row_prefetch.h"
#include "cpu/vec.h"

namespace minipaged::MINIPAGED_CPU_ISA {
namespace {

// Query rows per work item. 64 rows x 128 floats is 32 KiB of accumulator plus as much query:
// L1/L2-resident, and each K/V row is reused 64 times per load. The lane path rounds it up to
// whole steps of its microkernels (kStepGroups row groups: AVX2 72 rows, AVX-512 96), so that
// full tiles run no step on fewer groups, at a lower FMA rate.
#if defined(MINIPAGED_LANES)
constexpr int64_t kStepRows = kLanes * kStepGroups;
constexpr int64_t kTileRows = (64 + kStepRows - 1) / kStepRows * kStepRows;
#else
constexpr int64_t kTileRows = 64;
#endif

struct PrefillItem {
  int64_t seq, first_token, num_tokens, kv_head;  // tokens are new-token indices of the sequence
  int64_t cost;                                     // keys read x rows, for scheduling
};

// Per-thread buffers of one work item; rows are (token, head in group), token-major.
struct TileScratch {
  std::vector<float> q, scores, max_score, acc;
  std::vector<f32x16> exp_sum;
  std::vector<c10::BFloat16> q_bf16;
#if defined(MINIPAGED_LANES)
  // The lane path's (below), in vectors of kLanes floats: transposed query and accumulator, one chunk's
  // K and V rows (when copied), V as bfloat16 pairs, probabilities, running max and sum, query
  // positions.
  struct alignas(sizeof(Lanes)) Vector {
    float lanes[kLanes];
  };
  std::vector<Vector> qt, ot, k, v, v_pairs, p, max_score_lanes, exp_sum_lanes, position;
#endif
};

#if defined(MINIPAGED_LANES)
// The lane path (the idea and its microkernels: lane_kernels.h).

// Keys (or values) [kpos, kpos + n) of one kv head as kLanes rows of D elements of C, rows past n
// zero: the cache rows themselves when they are kLanes rows of one block already in C (n = kLanes never
// reaches past the sequence), else a copy, converted to C, in buf. An 8-bit cache's rows are
// dequantized into the copy: times their token's scale (int8: token_scales) or the layer's.
template <typename C, int D, typename T>
const C* chunk_rows(const T* cache, int64_t kpos, int64_t n, const CacheLayout& layout, const int32_t* block_table,
                    int64_t kv_head, C* buf, [[maybe_unused]] const float* token_scales,
                    [[maybe_unused]] float layer_scale) {
  const int64_t B = layout.block_size;
  if constexpr (std::is_same_v<C, T>)
    if (n == kLanes && kpos % B + kLanes <= B) return cache + layout.row(block_table[kpos / B], kv_head, kpos % B);
  for (int64_t t = 0; t < kLanes; ++t) {
    C* dst = buf + t * D;
    if (t >= n) {
      std::memset(static_cast<void*>(dst), 0, D * sizeof(C));
      continue;
    }
    const int64_t row = layout.row(block_table[(kpos + t) / B], kv_head, (kpos + t) % B);
    const T* src = cache + row;
    if constexpr (std::is_same_v<C, T>) {
      std::memcpy(static_cast<void*>(dst), src, D * sizeof(T));
    } else if constexpr (kQuantized<T>) {
      const float scale = token_scales != nullptr ? token_scales[row / D] : layer_scale;
      for (int64_t d = 0; d < D; d += kW) store(dst + d, load16(src + d) * scale);
    } else {
      for (int64_t d = 0; d < D; d += kW) store(dst + d, load16(src + d));  // C is float
    }
  }
  return buf;
}

// One work item on the lane path (see above); same contract as prefill_work_item.
template <typename Q, typename T, int D>
void prefill_item_lanes(const PrefillItem& item, const Q* query, int64_t q_token_stride, int64_t q_head_stride,
                        int64_t q_begin, int64_t context, float scale, const T* key_cache, const T* value_cache,
                        const CacheLayout& layout, const int32_t* block_table, int64_t group, Q* out,
                        int64_t num_heads, TileScratch& w, const KVScales& kv_scales) {
#if defined(__AVX512BF16__)
  constexpr bool kPairs = std::is_same_v<T, c10::BFloat16>;
#else
  constexpr bool kPairs = false;
#endif
  using C = std::conditional_t<kPairs, c10::BFloat16, float>;  // what K and V are multiplied as
  constexpr int kGroups = kPairs ? 1 : kStepGroups;            // row groups per microkernel call
  constexpr int64_t kQtVectors = kPairs ? D / 2 : D;           // qt vectors per row group
  const int64_t rows = item.num_tokens * group, h0 = item.kv_head * group;
  const int64_t row_groups = (rows + kLanes - 1) / kLanes;
  const int64_t first_pos = context + item.first_token, end = first_pos + item.num_tokens;

  // Lane r of row group g is row g * kLanes + r; the lanes past the last row repeat it (finite data,
  // same position, never written out).
  auto row_of = [&](int64_t g, int64_t r) { return std::min(g * kLanes + r, rows - 1); };
  // Positions grow with the row: a group's first and last rows bound the keys it sees.
  auto lowest = [&](int64_t g) { return first_pos + g * kLanes / group; };
  auto highest = [&](int64_t g) { return first_pos + row_of(g, kLanes - 1) / group; };
  w.qt.resize(row_groups * kQtVectors);
  w.ot.assign(row_groups * D, {});
  w.p.resize(kGroups * kLanes);
  w.position.resize(row_groups);
  w.max_score_lanes.resize(row_groups);
  w.exp_sum_lanes.assign(row_groups, {});
  auto vec = [](auto& v, int64_t i) { return reinterpret_cast<float*>(v.data() + i); };
  for (int64_t g = 0; g < row_groups; ++g) {
    alignas(64) int32_t pos[kLanes];
    for (int64_t r = 0; r < kLanes; ++r) {
      const int64_t row = row_of(g, r);
      pos[r] = static_cast<int32_t>(first_pos + row / group);
      const Q* src = query + (q_begin + item.first_token + row / group) * q_token_stride + (h0 + row % group) * q_head_stride;
      if constexpr (kPairs) {
        uint32_t* qt = reinterpret_cast<uint32_t*>(w.qt.data() + g * kQtVectors);
        for (int64_t i = 0; i < D / 2; ++i) {
          uint32_t pair;
          std::memcpy(&pair, src + 2 * i, sizeof(pair));  // bfloat16 (2i, 2i+1), the first in the low half
          qt[i * kLanes + r] = pair;
        }
      } else {
        float* qt = reinterpret_cast<float*>(w.qt.data() + g * kQtVectors);
        for (int64_t d = 0; d < D; ++d) qt[d * kLanes + r] = static_cast<float>(src[d]) * scale;
      }
    }
    std::memcpy(w.position.data() + g, pos, sizeof(pos));
    lanes_store(vec(w.max_score_lanes, g), lanes_set1(-std::numeric_limits<float>::infinity()));
  }

  // Online softmax of row group g over the chunk of keys [kpos, kpos + n), lane-wise: s (its scores)
  // becomes exp(s - new max), rescale the factor on its running state; true if any lane's differs from 1.
  // Every lane sees key 0 in the first chunk, so the running max is finite from then on and a
  // chunk a lane sees nothing of leaves it as it was.
  auto softmax_chunk = [&](int64_t g, int64_t kpos, int64_t n, Lanes (&s)[kLanes], Lanes& rescale)
                           __attribute__((always_inline)) {
    if (kpos + kLanes - 1 > lowest(g) || n < kLanes) {
      // Key kpos + t is visible to the lanes at or after it, and only if it exists.
      for (int t = 0; t < kLanes; ++t)
        s[t] = lanes_visible(s[t], lanes_load_ints(w.position.data() + g), static_cast<int32_t>(kpos + t), t < n);
    }
    Lanes chunk_max = s[0];
    for (int t = 1; t < kLanes; ++t) chunk_max = lanes_max(chunk_max, s[t]);
    const Lanes old_max = lanes_load(vec(w.max_score_lanes, g));
    const Lanes new_max = lanes_max(old_max, chunk_max);
    rescale = lanes_exp(lanes_sub(old_max, new_max));
    lanes_store(vec(w.max_score_lanes, g), new_max);
    Lanes sum = lanes_zero();
    for (int t = 0; t < kLanes; ++t) {
      s[t] = lanes_exp(lanes_sub(s[t], new_max));
      sum = lanes_add(sum, s[t]);
    }
    lanes_store(vec(w.exp_sum_lanes, g), lanes_fmadd(lanes_load(vec(w.exp_sum_lanes, g)), rescale, sum));
    return lanes_any_not_one(rescale);
  };

  constexpr int64_t kChunkVectors = kLanes * D * sizeof(C) / sizeof(Lanes);
  w.k.resize(kChunkVectors);
  w.v.resize(kChunkVectors);
  if (kPairs) w.v_pairs.resize(D / 2);
  for (int64_t kpos = 0; kpos < end; kpos += kLanes) {
    const int64_t n = std::min<int64_t>(kLanes, end - kpos);
    const C* k = chunk_rows<C, D>(key_cache, kpos, n, layout, block_table, item.kv_head, reinterpret_cast<C*>(w.k.data()),
                                  kv_scales.key, kv_scales.key_layer);
    const C* v = chunk_rows<C, D>(value_cache, kpos, n, layout, block_table, item.kv_head, reinterpret_cast<C*>(w.v.data()),
                                  kv_scales.value, kv_scales.value_layer);
#if defined(__AVX512BF16__)
    if constexpr (kPairs) pair_rows<D>(v, reinterpret_cast<uint32_t*>(w.v_pairs.data()));
#endif
    // The next chunk's K/V rows are asked for a share per step of row groups: the blocks are scattered, so
    // no hardware prefetcher sees them coming, and a steady trickle keeps the FMAs fed.
    const int64_t next = kpos + kLanes, next_rows = std::min<int64_t>(kLanes, end - next);
    const int64_t first_live = std::max<int64_t>(0, (kpos - first_pos) * group / kLanes);
    const int64_t live_groups = row_groups - first_live;
    int64_t prefetched = 0;
    // The groups the causal mask hides this chunk from (kpos past their highest position) are a
    // prefix of a step.
    auto hidden = [&](int64_t g) { return kpos > highest(g); };
    for (int64_t step = 0; step < row_groups; step += kGroups) {
      const int64_t last = std::min(step + kGroups, row_groups) - 1;
      int64_t g0 = step;
      while (g0 <= last && hidden(g0)) ++g0;
      if (g0 > last) continue;
      for (const int64_t upto = next_rows * (last - first_live + 1) / std::max<int64_t>(1, live_groups); prefetched < upto;
           ++prefetched) {
        const int64_t pos = next + prefetched, row = layout.row(block_table[pos / layout.block_size], item.kv_head,
                                                                pos % layout.block_size);
        prefetch(reinterpret_cast<const char*>(key_cache + row), D * sizeof(T));
        prefetch(reinterpret_cast<const char*>(value_cache + row), D * sizeof(T));
      }
      with_count<kGroups>(last - g0 + 1, [&](auto groups) __attribute__((always_inline)) {
        constexpr int G = decltype(groups)::value;
        Lanes s[G][kLanes], rescale[G];
        bool rescaled[G];
        if constexpr (kPairs) {
#if defined(__AVX512BF16__)
          lane_scores_pairs<D>(reinterpret_cast<const uint32_t*>(w.qt.data() + g0 * kQtVectors), k, s[0]);
          for (int t = 0; t < kLanes; ++t) s[0][t] = lanes_mul(s[0][t], lanes_set1(scale));
#endif
        } else {
          lane_scores<D, G>(reinterpret_cast<const float*>(w.qt.data() + g0 * kQtVectors), D * kLanes, k, s);
        }
        for (int i = 0; i < G; ++i) rescaled[i] = softmax_chunk(g0 + i, kpos, n, s[i], rescale[i]);
        float* ot = reinterpret_cast<float*>(w.ot.data() + g0 * D);
        if constexpr (kPairs) {
#if defined(__AVX512BF16__)
          __m512i p[kLanes / 2];
          pair_probabilities(s[0], p);
          lane_accumulate_pairs<D>(p, reinterpret_cast<const uint32_t*>(w.v_pairs.data()), ot, rescale, rescaled);
#endif
        } else {
          for (int i = 0; i < G; ++i)
            for (int t = 0; t < kLanes; ++t) lanes_store(vec(w.p, i * kLanes + t), s[i][t]);
          lane_accumulate<D, G>(vec(w.p, 0), v, ot, rescale, rescaled);
        }
      });
    }
  }
  // Every lane saw key 0, so its sum is positive.
  for (int64_t g = 0; g < row_groups; ++g) {
    alignas(64) float inv[kLanes];
    lanes_store(inv, lanes_div(lanes_set1(1.f), lanes_load(vec(w.exp_sum_lanes, g))));
    const float* ot = reinterpret_cast<const float*>(w.ot.data() + g * D);
    for (int64_t r = 0; r < kLanes && g * kLanes + r < rows; ++r) {
      const int64_t row = g * kLanes + r;
      Q* dst = out + ((q_begin + item.first_token + row / group) * num_heads + h0 + row % group) * D;
      for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<Q>(ot[d * kLanes + r] * inv[r]);
    }
  }
}

// The lane path for this item, if it has one (head_dim 64, 128 or 256, and enough rows to fill
// the lanes); false: the caller takes the generic path.
template <typename Q, typename T>
bool prefill_lanes(const PrefillItem& item, const Q* query, int64_t q_token_stride, int64_t q_head_stride,
                   int64_t q_begin, int64_t context, float scale, const T* key_cache, const T* value_cache,
                   const CacheLayout& layout, const int32_t* block_table, int64_t group, Q* out, int64_t num_heads,
                   TileScratch& w, const KVScales& kv_scales) {
  if (item.num_tokens * group < kLanes) return false;
  auto run = [&](auto head_dim) {
    prefill_item_lanes<Q, T, decltype(head_dim)::value>(item, query, q_token_stride, q_head_stride, q_begin, context,
                                                        scale, key_cache, value_cache, layout, block_table, group,
                                                        out, num_heads, w, kv_scales);
    return true;
  };
  switch (layout.head_dim) {
    case 64: return run(std::integral_constant<int, 64>{});
    case 128: return run(std::integral_constant<int, 128>{});
    case 256: return run(std::integral_constant<int, 256>{});
    default: return false;
  }
}
#endif

}  // namespace
}  // namespace minipaged::MINIPAGED_CPU_ISA
