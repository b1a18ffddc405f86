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
#include "cpu/isa.h"
#include "cpu/quantize.h"
#include "cpu/vec.h"

namespace minipaged::MINIPAGED_CPU_ISA {
namespace {

constexpr int64_t kPartitionTokens = 512;  // most tokens per work item along the context
// How far ahead of the rows being computed K/V lines are prefetched, in reading order. A few KiB
// covers memory latency at one core's bandwidth and stays well inside L1; a whole block ahead
// (64 KiB in float32) does not. Measured 4-11% better than prefetching the next block's rows
// (bench/RESULTS.md).
constexpr int64_t kAheadBytes = 4096;
// Most bytes of scores a work item holds at once (a chunk of blocks, every query head), small
// enough to stay in L1/L2 between Q.K and P.V: 512 tokens per chunk at 16 heads, 128 at 64.
constexpr int64_t kChunkScoreBytes = 32 << 10;

// One line of every 4 KiB page of the next run, into L2 (prefetcht2), as a block's run begins. The
// row stream asks for lines only kAheadBytes ahead; asking for each page of the next scattered run
// a whole run earlier made decode 1.07x (float32) and 1.09x (bfloat16) faster from memory, in 2 MiB
// pages too, so it is not only the TLB (bench/RESULTS.md).
inline void touch_pages(const char* run, int64_t bytes) {
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
// 8-bit caches (T int8_t, fp8_e4m3, fp8_e5m2): the rows convert in registers (load16); an fp8
// layer's K scale is in q already and its V scale multiplies the result; int8's per-token scales
// multiply each block's scores (K) and probabilities (V), a float per token and head.
template <typename T>
void decode_work_item(const float* q,  // [num_heads, head_dim] of this sequence, already scaled
                      const T* q_raw, float scale,  // the same, as given (unscaled, cache dtype)
                      const T* key_cache, const T* value_cache, const CacheLayout& layout,
                      const int32_t* block_table, int64_t begin, int64_t end, int64_t group, Partial out,
                      std::vector<float>& scratch, const KVScales& kv_scales, bool query_16bit) {
  const int64_t D = layout.head_dim, B = layout.block_size, num_heads = layout.num_kv_heads * group;
  TORCH_INTERNAL_ASSERT_DEBUG_ONLY(begin < end && begin % B == 0);
#if defined(__AVX512BF16__)
  const bool bf16_dot = std::is_same_v<T, c10::BFloat16> && D % 32 == 0 && B <= 256;
#else
  const bool bf16_dot = false;
#endif
#if defined(__AVX512VNNI__)
  // Only for a 16-bit query: its int16 rounding (quantize_query) then loses less than the query's
  // own float16 / bfloat16 rounding did; a float32 query keeps float32 multiply-adds.
  const bool int8_dot = std::is_same_v<T, int8_t> && query_16bit && D % 32 == 0 && D <= 512 && B <= 256;
#else
  const bool int8_dot = false;
#endif
  const int64_t chunk_blocks =
      std::max<int64_t>(1, kChunkScoreBytes / static_cast<int64_t>(num_heads * B * sizeof(float)));
  const int64_t C = chunk_blocks * B;  // scores per head in a chunk
  // Scores, per-lane exponential sums, and (int8_dot) the query as int16 and its per-head scales.
  scratch.assign(num_heads * C + num_heads * kW + (int8_dot ? num_heads + num_heads * D / 2 : 0), 0.f);
  float* scores = scratch.data();  // [num_heads, C]
  auto* exp_sums = reinterpret_cast<f32x16*>(scores + num_heads * C);  // [num_heads], per lane
  float* q_scale = int8_dot ? scores + num_heads * C + num_heads * kW : nullptr;  // [num_heads]
  auto* q16 = int8_dot ? reinterpret_cast<int16_t*>(q_scale + num_heads) : nullptr;  // [num_heads, head_dim]
#if defined(__AVX512VNNI__)
  if (int8_dot) quantize_query(q, num_heads, D, q16, q_scale);
#endif
  std::fill(out.max_score, out.max_score + num_heads, -std::numeric_limits<float>::infinity());
  std::fill(out.acc, out.acc + num_heads * D, 0.f);

  // Each tile of query heads sharing a kv head: g0 = first query head, gt = how many (one tile
  // unless the group is larger than kMaxTile).
  auto for_each_tile = [&](auto&& f) {
    for (int64_t kv_head = 0; kv_head < layout.num_kv_heads; ++kv_head)
      for (int64_t g0 = kv_head * group; g0 < (kv_head + 1) * group; g0 += kMaxTile)
        f(kv_head, g0, std::min(kMaxTile, (kv_head + 1) * group - g0));
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
        with_tile(gt, [&](auto tile) {
#if defined(__AVX512BF16__)
          if constexpr (std::is_same_v<T, c10::BFloat16>)
            if (bf16_dot) return tile.scores_bf16(q_raw + g0 * D, scale, k, n, D, scores + g0 * C + t0, C, pf);
#endif
#if defined(__AVX512VNNI__)
          if constexpr (std::is_same_v<T, int8_t>)
            if (int8_dot)
              return tile.scores_int8(q16 + g0 * D, q_scale + g0, k, k_scales + kv_head * B, n, D, scores + g0 * C + t0,
                                      C, pf);
#endif
          tile.scores(q + g0 * D, k, n, D, scores + g0 * C + t0, C, pf);
          if constexpr (kPerTokenScales) scale_tokens(scores + g0 * C + t0, gt, k_scales + kv_head * B, n);
        });
      });
    });
    for (int64_t h = 0; h < num_heads; ++h)
      softmax_update(scores + h * C, n_chunk, out.max_score[h], exp_sums[h], out.acc + h * D, D);
    for_each_block(value_cache, [&](const T* v_rows, int64_t n, const char* next_run, int64_t t0,
                                    [[maybe_unused]] const float* v_scales) {
      for_each_tile([&](int64_t kv_head, int64_t g0, int64_t gt) {
        const T* v = v_rows + kv_head * B * D;
        RowPrefetch pf = ahead_of(v_rows, next_run, kv_head, g0);
        with_tile(gt, [&](auto tile) {
#if defined(__AVX512VNNI__)
          if constexpr (std::is_same_v<T, int8_t>)
            if (int8_dot)
              return tile.accumulate_int8(scores + g0 * C + t0, C, v, v_scales + kv_head * B, n, D, out.acc + g0 * D, pf);
#endif
          if constexpr (kPerTokenScales) scale_tokens(scores + g0 * C + t0, gt, v_scales + kv_head * B, n);
#if defined(__AVX512BF16__)
          if constexpr (std::is_same_v<T, c10::BFloat16>)
            if (bf16_dot) return tile.accumulate_bf16(scores + g0 * C + t0, C, v, n, D, out.acc + g0 * D, pf);
#endif
          tile.accumulate(scores + g0 * C + t0, C, v, n, D, out.acc + g0 * D, pf);
        });
      });
    });
  }
  for (int64_t h = 0; h < num_heads; ++h) out.exp_sum[h] = hsum(exp_sums[h]);
  if constexpr (kQuantized<T>)
    if (kv_scales.value_layer != 1.f)
      for (int64_t i = 0; i < num_heads * D; ++i) out.acc[i] *= kv_scales.value_layer;
  if (bf16_dot || int8_dot)
    for (int64_t h = 0; h < num_heads; ++h) from_unpack_order(out.acc + h * D, D);
}

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
  at::Tensor max_score = at::empty({num_seqs, num_heads, stored_parts}, query.options().dtype(at::kFloat));
  at::Tensor exp_sum = at::empty_like(max_score);
  at::Tensor acc = at::empty({num_seqs, num_heads, stored_parts, D}, max_score.options());
  at::Tensor out = at::empty({num_seqs, num_heads, D}, query.options());

  MINIPAGED_DISPATCH(query.scalar_type(), "paged_attention_decode_cpu", [&] {
    const scalar_t* qp = q_raw.const_data_ptr<scalar_t>();
    // The work item by cache format: the query is float from here on, so an 8-bit format's
    // kernel is compiled once, whatever the query dtype.
    auto work_item = [&](const float* q, const scalar_t* q_seq, const int32_t* block_table, int64_t begin, int64_t end,
                         Partial partial, std::vector<float>& scratch) {
      auto run = [&](auto* cache_type) {
        using T = std::remove_const_t<std::remove_pointer_t<decltype(cache_type)>>;
        const T* q_cache = nullptr;
        if constexpr (std::is_same_v<T, scalar_t>) q_cache = q_seq;
        decode_work_item<T>(q, q_cache, static_cast<float>(scale), static_cast<const T*>(key_cache.const_data_ptr()),
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
    float* mp = max_score.data_ptr<float>();
    float* ep = exp_sum.data_ptr<float>();
    float* ap = acc.data_ptr<float>();
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
      std::vector<float> scratch, q(num_heads * D), m(num_heads), l(num_heads), a(num_heads * D), row(D);
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
  const at::Tensor slots = slot_mapping.to(at::kLong).contiguous();
  const int64_t* sp = slots.const_data_ptr<int64_t>();
  const int64_t D = layout.head_dim;
  if (format != KVFormat::kNone) {
    const bool per_token = format == KVFormat::kInt8;
    return cpu::quantize_and_cache(key, value, key_cache, value_cache, sp, layout, format,
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
      scalar_t* const first_row = dst_base + layout.slot_row(sp[i], 0);  // one division per token
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
        if (sp[i] < 0) continue;
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
