// One decode work item on the CPU: a sequence's tokens [begin, end) against all its query heads,
// with the prefetch scheme and the chunked online softmax that keep it at the memory's pace.
// Included only by kernels.cpp (the op, its partitions and their merge), once per instruction-set
// object (cpu/isa.h).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <type_traits>

#include "cache_layout.h"
#include "cpu/head_tile.h"
#include "cpu/isa.h"
#include "cpu/row_prefetch.h"
#include "cpu/tile_amx.h"
#include "cpu/vec.h"

namespace minipaged::MINIPAGED_CPU_ISA {
namespace {

// How far ahead of the rows being computed K/V lines are prefetched (into L2, see prefetch()), in
// reading order: 16 KiB covers memory latency while the arithmetic runs at its in-cache pace (an
// 8-bit row is consumed at 50+ GB/s). 4 KiB, into L1, left a one-thread decode waiting on memory
// for most of its arithmetic (bench/RESULTS.md).
constexpr int64_t kAheadBytes = 16 << 10;
// Most bytes of scores a work item holds at once (a chunk of blocks, every query head), small
// enough to stay in L1/L2 between Q.K and P.V: 512 tokens per chunk at 16 heads, 128 at 64.
constexpr int64_t kChunkScoreBytes = 32 << 10;

// One line of every 4 KiB page of the next run, into L2 (prefetcht2), as a block's run begins. The
// row stream asks for lines only kAheadBytes ahead; asking for each page of the next scattered run
// a whole run earlier made decode 1.07x (float32) and 1.09x (bfloat16) faster from memory, in 2 MiB
// pages too, so it is not only the TLB (bench/RESULTS.md).
__attribute__((always_inline)) inline void touch_pages(const char* run, int64_t bytes) {  // see prefetch()
  for (int64_t offset = 0; offset < bytes; offset += 4096) __builtin_prefetch(run + offset, 0, 1);
}

// Running softmax state of one work item: per query head of the sequence, the max score seen,
// the sum of exp(score - max), and the exp-weighted sum of V rows.
struct Partial {
  float* max_score;  // [num_heads]
  float* exp_sum;    // [num_heads]
  float* acc;        // [num_heads, head_dim]
};

// One sequence, tokens [begin, end) (begin < end, begin on a block boundary), every kv head,
// a chunk of blocks at a time: Q.K of the chunk's blocks, one softmax step per query head over
// all of them (online across chunks), then P.V of its blocks. A chunk's scores stay in cache
// (kChunkScoreBytes) between the phases. Against a softmax step per block, this spares small
// blocks (16 bfloat16 tokens: 8 KiB of K/V per kv head) a max, horizontal max and rescale test
// each: 6-14% faster in cache for bfloat16, float32 within 5%; from memory the same
// (bench/RESULTS.md).
// 8-bit caches (T int8_t, fp8_e4m3, fp8_e5m2): the rows convert in registers (load16, or for fp8
// under a bfloat16 query bf16x32); an fp8 layer's K scale is in q already (in the scores' scale on
// the bfloat16 path) and its V scale multiplies the result; int8's per-token scales
// multiply each block's scores (K) and probabilities (V), a float per token and head.
template <typename T>
void decode_work_item(const float* q,  // [num_heads, head_dim] of this sequence, already scaled
                      const c10::BFloat16* q_bf16, float scale,  // the same as given (unscaled) if bfloat16, else null
                      const T* key_cache, const T* value_cache, const CacheLayout& layout,
                      const int32_t* block_table, int64_t begin, int64_t end, int64_t group, Partial out,
                      std::vector<float>& scratch, const KVScales& kv_scales, bool query_16bit) {
  const int64_t D = layout.head_dim, B = layout.block_size, num_heads = layout.num_kv_heads * group;
  TORCH_INTERNAL_ASSERT_DEBUG_ONLY(begin < end && begin % B == 0);
#if defined(__AMX_BF16__)
  const bool amx = std::is_same_v<T, c10::BFloat16> && D % 64 == 0 && D <= kAmxMaxHeadDim && B % 16 == 0 &&
                   group <= kAmxMaxGroup && cpu_dispatch::os_allows_amx();
#else
  const bool amx = false;
#endif
#if defined(__AVX512BF16__)
  // fp8 caches too, under a bfloat16 query: their bytes become bfloat16 in registers (bf16x32).
  const bool bf16_dot = (std::is_same_v<T, c10::BFloat16> || kFp8<T>) && q_bf16 != nullptr && D % 32 == 0 &&
                        B <= 256 && !amx;
#else
  const bool bf16_dot = false;
#endif
#if defined(MINIPAGED_INT16_PAIRS)
  // Only for a 16-bit query: its int16 rounding (quantize_query) then loses less than the query's
  // own float16 / bfloat16 rounding did; a float32 query keeps float32 multiply-adds.
  const bool int8_dot = std::is_same_v<T, int8_t> && query_16bit && D % 32 == 0 && D <= 512 && B <= 256 &&
                        group <= kInt8MaxGroup;
#else
  const bool int8_dot = false;
#endif
#if defined(MINIPAGED_LANES) && !defined(__AVX512F__)
  // AVX2: bfloat16 and fp8 rows read in pair order (bf16_pairs, fp8_pairs), the query copied into
  // it and the accumulators put back at the end. fp8's query and probabilities are multiplied by
  // kFp8PairsScale: not where that could overflow the query (beyond any real one) or denormals
  // read as zero.
  constexpr bool kPairOrderable = std::is_same_v<T, c10::BFloat16> || kFp8<T>;
  auto small_query = [&] {  // q * kFp8PairsScale below 2^127; false for NaN too
    for (int64_t i = 0; i < num_heads * D; ++i)
      if (!(std::abs(q[i]) < 0x1p15f)) return false;
    return true;
  };
  const bool pair_order = std::is_same_v<T, c10::BFloat16> || (kFp8<T> && fp8_pairs_allowed() && small_query());
#else
  constexpr bool kPairOrderable = false;
  const bool pair_order = false;
#endif
  const bool fp8_pairs_scaled = kFp8<T> && pair_order;
  // Calls f(rows) with the rows at p as the tiles read them: in pair order or as they are.
  auto with_rows = [&](const T* p, auto&& f) {
    if constexpr (std::is_same_v<T, c10::BFloat16> && kPairOrderable) return f(reinterpret_cast<const bf16_pairs*>(p));
    else if constexpr (kFp8<T> && kPairOrderable) {
      if (pair_order) return f(reinterpret_cast<const fp8_pairs<T>*>(p));
      return f(p);
    } else return f(p);
  };
  const int64_t chunk_blocks =
      std::max<int64_t>(1, kChunkScoreBytes / static_cast<int64_t>(num_heads * B * sizeof(float)));
  const int64_t C = chunk_blocks * B;  // scores per head in a chunk
  // Scores, per-lane exponential sums, and (int8_dot) the query as int16 and its per-head scales,
  // or (pair_order) the query in pair order, or (amx) the query as pairs and the chunk's P tiles.
  // Only the sums start from zero: everything else is written before it is read, and the buffer
  // is the caller's, kept across calls (zeroing ~100 KiB per work item showed in profiles).
  const auto scratch_size =
      static_cast<size_t>(num_heads * C + num_heads * kW + (int8_dot ? num_heads + num_heads * D / 2 : 0) +
                          (pair_order ? num_heads * D : 0) + (amx ? num_heads * D / 2 + 2 * num_heads * C + kW : 0));
  if (scratch.size() < scratch_size) scratch.resize(scratch_size);
  float* scores = scratch.data();  // [num_heads, C]
  auto* exp_sums = reinterpret_cast<f32x16*>(scores + num_heads * C);  // [num_heads], per lane
  std::fill(exp_sums, exp_sums + num_heads, f32x16{});
  float* q_scale = int8_dot ? scores + num_heads * C + num_heads * kW : nullptr;  // [num_heads]
  auto* q16 = int8_dot ? reinterpret_cast<int16_t*>(q_scale + num_heads) : nullptr;  // [num_heads, head_dim]
#if defined(MINIPAGED_INT16_PAIRS)
  if (int8_dot) quantize_query(q, num_heads, D, q16, q_scale);
#endif
  const float* q_tile = q;  // the query as the float tiles read it
  if (pair_order) {
    float* q_pairs_order = scores + num_heads * C + num_heads * kW;
    for (int64_t h = 0; h < num_heads; ++h) to_even_odd_order<8>(q + h * D, D, q_pairs_order + h * D);
    if (fp8_pairs_scaled)
      for (int64_t i = 0; i < num_heads * D; ++i) q_pairs_order[i] *= kFp8PairsScale;
    q_tile = q_pairs_order;
  }
  // amx: a tile holds every query head of a kv head (the group), the query as its pairs.
  const int64_t tile_heads = amx ? group : kMaxTile;
#if defined(__AMX_BF16__)
  std::optional<AmxTiles> tiles;
  auto* q_pairs = reinterpret_cast<uint32_t*>(scores + num_heads * C + num_heads * kW);  // [num_heads, head_dim / 2]
  // Per tile of heads g0, 2 gt C words, 64-byte aligned (tile rows): the chunk's P tiles as
  // probability_pairs lays them out, and in its Q.K phase its score tiles (half of it, as floats).
  auto* p_pairs =
      reinterpret_cast<uint32_t*>((reinterpret_cast<uintptr_t>(q_pairs + num_heads * D / 2) + 63) & ~uintptr_t{63});
  auto pair_tiles = [&](int64_t g0) { return p_pairs + g0 * 2 * C; };
  auto score_tiles = [&](int64_t g0) { return reinterpret_cast<float*>(pair_tiles(g0)); };
  if constexpr (std::is_same_v<T, c10::BFloat16>)
    if (amx) {
      tiles.emplace(group);
      for (int64_t kv_head = 0; kv_head < layout.num_kv_heads; ++kv_head)
        tiles->query_pairs(q_bf16 + kv_head * group * D, D, q_pairs + kv_head * group * D / 2);
    }
#endif
  std::fill(out.max_score, out.max_score + num_heads, -std::numeric_limits<float>::infinity());
  std::fill(out.acc, out.acc + num_heads * D, 0.f);

  // Each tile of query heads sharing a kv head: g0 = first query head, gt = how many (one tile
  // unless the group is larger than tile_heads).
  auto for_each_tile = [&](auto&& f) {
    for (int64_t kv_head = 0; kv_head < layout.num_kv_heads; ++kv_head)
      for (int64_t g0 = kv_head * group; g0 < (kv_head + 1) * group; g0 += tile_heads)
        f(kv_head, g0, std::min(tile_heads, (kv_head + 1) * group - g0));
  };
  // Blocks are scattered, so the hardware prefetcher cannot follow from one to the next: as
  // rows are computed, the lines kAheadBytes further on in reading order are asked for, a few
  // at a time (RowPrefetch): the rest of this run, then the next one. Each block's K (all kv
  // heads) is one contiguous run, and so is its V (the hardware prefetcher streams long runs
  // better than a run per kv head, bench/RESULTS.md); the reading order is the K runs of a
  // chunk's blocks, then their V runs, then the next chunk's. The first lines are asked for at once.
  const int64_t row_bytes = D * static_cast<int64_t>(sizeof(T));
  const int64_t run_bytes = layout.block_elems() * static_cast<int64_t>(sizeof(T));  // a block's K (or V)
  const int64_t num_blocks = (end - begin + B - 1) / B;
  const int32_t* blocks = block_table + begin / B;
  auto run = [&](const T* cache, int64_t i) { return cache + layout.row(blocks[i], 0, 0); };
  // int8: the scales of block i's run in `cache` (key or value), B per kv head.
  constexpr bool kPerTokenScales = std::is_same_v<T, int8_t>;
  auto scale_run = [&](const T* cache, int64_t i) {
    return (cache == key_cache ? kv_scales.key : kv_scales.value) + blocks[i] * layout.num_kv_heads * B;
  };
  const int64_t scale_run_bytes = layout.num_kv_heads * B * static_cast<int64_t>(sizeof(float));
  // The prefetch stream for a kv head's rows of `rows`, continuing into `next_run`; only the
  // first tile of a kv head drives it (the others read the same rows).
  auto ahead_of = [&](const T* rows, const char* next_run, int64_t kv_head, int64_t g0) {
    if (g0 != kv_head * group) return RowPrefetch{};
    return RowPrefetch::ahead(reinterpret_cast<const char*>(rows), run_bytes, next_run, kv_head * B * row_bytes,
                              kAheadBytes, row_bytes, B);
  };
  prefetch(reinterpret_cast<const char*>(run(key_cache, 0)), std::min(run_bytes, kAheadBytes));
  for (int64_t c0 = 0; c0 < num_blocks; c0 += chunk_blocks) {
    const int64_t c1 = std::min(c0 + chunk_blocks, num_blocks);
    const int64_t n_chunk = std::min(end, begin + c1 * B) - (begin + c0 * B);  // tokens in this chunk
    // Calls f(rows, n, next_run, offset, scales) for each block of the chunk: `rows` its K (or V), n
    // of its tokens in use, the run after it in reading order, its first token's index in the
    // chunk, and (int8) its scales.
    auto for_each_block = [&](const T* cache, auto&& f) {
      for (int64_t i = c0; i < c1; ++i) {
        const T* next_cache = i + 1 < c1 ? cache : cache == key_cache ? value_cache : key_cache;
        const int64_t next_i = i + 1 < c1 ? i + 1 : cache == key_cache ? c0 : c1;
        const T* next = next_i < num_blocks ? run(next_cache, next_i) : nullptr;
        if (next != nullptr) touch_pages(reinterpret_cast<const char*>(next), run_bytes);
        const float* scales = nullptr;
        if constexpr (kPerTokenScales) {
          scales = scale_run(cache, i);
          if (next != nullptr) prefetch(reinterpret_cast<const char*>(scale_run(next_cache, next_i)), scale_run_bytes);
        }
        f(run(cache, i), std::min(B, n_chunk - (i - c0) * B), reinterpret_cast<const char*>(next), (i - c0) * B,
          scales);
      }
    };
    // rows[g * C + t] *= scales[t] for the tile's heads: int8's per-token scales.
    auto scale_tokens = [&](float* rows, int64_t gt, const float* scales, int64_t n) {
      for (int64_t g = 0; g < gt; ++g)
        for (int64_t t = 0; t < n; ++t) rows[g * C + t] *= scales[t];
    };
    for_each_block(key_cache, [&](const T* k_rows, int64_t n, const char* next_run, int64_t t0,
                                  [[maybe_unused]] const float* k_scales) {
      for_each_tile([&](int64_t kv_head, int64_t g0, int64_t gt) {
        const T* k = k_rows + kv_head * B * D;
        RowPrefetch pf = ahead_of(k_rows, next_run, kv_head, g0);
#if defined(__AMX_BF16__)
        if constexpr (std::is_same_v<T, c10::BFloat16>)
          if (amx) return tiles->scores(q_pairs + g0 * D / 2, k, n, D, score_tiles(g0) + t0 * gt, pf);
#endif
        with_tile(gt, [&](auto tile) {
#if defined(__AVX512BF16__)
          if constexpr (std::is_same_v<T, c10::BFloat16> || kFp8<T>)
            if (bf16_dot)  // an fp8 layer's K scale (1 otherwise) applies to the scores
              return tile.scores_bf16(q_bf16 + g0 * D, scale * kv_scales.key_layer, k, n, D, scores + g0 * C + t0, C,
                                      pf);
#endif
#if defined(MINIPAGED_INT16_PAIRS)
          if constexpr (std::is_same_v<T, int8_t>)
            if (int8_dot)
              return tile.scores_int8(q16 + g0 * D, q_scale + g0, k, k_scales + kv_head * B, n, D, scores + g0 * C + t0,
                                      C, pf);
#endif
          with_rows(k, [&](auto rows) { tile.scores(q_tile + g0 * D, rows, n, D, scores + g0 * C + t0, C, pf); });
          if constexpr (kPerTokenScales) scale_tokens(scores + g0 * C + t0, gt, k_scales + kv_head * B, n);
        });
      });
    });
#if defined(__AMX_BF16__)
    if (amx)
      for_each_tile([&](int64_t, int64_t g0, int64_t) {
        tiles->head_rows(score_tiles(g0), scale, n_chunk, scores + g0 * C, C);
      });
#endif
    for (int64_t h = 0; h < num_heads; ++h)
      softmax_update(scores + h * C, n_chunk, out.max_score[h], exp_sums[h], out.acc + h * D, D);
    if (fp8_pairs_scaled)
      for (int64_t h = 0; h < num_heads; ++h)
        for (int64_t t = 0; t < n_chunk; ++t) scores[h * C + t] *= kFp8PairsScale;
#if defined(__AMX_BF16__)
    if (amx)
      for_each_tile([&](int64_t, int64_t g0, int64_t) {
        tiles->probability_pairs(scores + g0 * C, C, n_chunk, pair_tiles(g0));
      });
#endif
    for_each_block(value_cache, [&](const T* v_rows, int64_t n, const char* next_run, int64_t t0,
                                    [[maybe_unused]] const float* v_scales) {
      for_each_tile([&](int64_t kv_head, int64_t g0, int64_t gt) {
        const T* v = v_rows + kv_head * B * D;
        RowPrefetch pf = ahead_of(v_rows, next_run, kv_head, g0);
#if defined(__AMX_BF16__)
        if constexpr (std::is_same_v<T, c10::BFloat16>)
          if (amx) return tiles->accumulate(pair_tiles(g0) + t0 * 2 * gt, v, n, D, out.acc + g0 * D, pf);
#endif
        with_tile(gt, [&](auto tile) {
#if defined(MINIPAGED_INT16_PAIRS)
          if constexpr (std::is_same_v<T, int8_t>)
            if (int8_dot)
              return tile.accumulate_int8(scores + g0 * C + t0, C, v, v_scales + kv_head * B, n, D, out.acc + g0 * D, pf);
#endif
          if constexpr (kPerTokenScales) scale_tokens(scores + g0 * C + t0, gt, v_scales + kv_head * B, n);
#if defined(__AVX512BF16__)
          if constexpr (std::is_same_v<T, c10::BFloat16> || kFp8<T>)
            if (bf16_dot) return tile.accumulate_bf16(scores + g0 * C + t0, C, v, n, D, out.acc + g0 * D, pf);
#endif
          with_rows(v, [&](auto rows) { tile.accumulate(scores + g0 * C + t0, C, rows, n, D, out.acc + g0 * D, pf); });
        });
      });
    });
  }
  for (int64_t h = 0; h < num_heads; ++h) out.exp_sum[h] = hsum(exp_sums[h]);
  if constexpr (kQuantized<T>)
    if (kv_scales.value_layer != 1.f)
      for (int64_t i = 0; i < num_heads * D; ++i) out.acc[i] *= kv_scales.value_layer;
  if (pair_order)
    for (int64_t h = 0; h < num_heads; ++h) from_even_odd_order<8>(out.acc + h * D, D);
#if defined(MINIPAGED_LANES)  // the pair paths' sums, in vectors of kLanes int32 lanes
  if (bf16_dot || int8_dot)
    for (int64_t h = 0; h < num_heads; ++h) from_unpack_order<kLanes>(out.acc + h * D, D);
#endif
#if defined(__AMX_BF16__)
  if (amx)
    for (int64_t h = 0; h < num_heads; ++h) from_even_odd_order<16>(out.acc + h * D, D);
#endif
}

}  // namespace
}  // namespace minipaged::MINIPAGED_CPU_ISA
