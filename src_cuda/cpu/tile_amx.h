// bfloat16 decode on AMX tiles (the avx512_amx variant): Q.K and P.V as tile dot products, 16
// tokens of a block at a time. A tile dot product costs about as much as 8-16 pair dot products
// and does 16-256 times their work, so the arithmetic of a block shrinks to a few instructions
// and what is left is reading the rows.
//
// Q.K: the 16 K rows of a token group are tile A as they lie in the cache (16 rows of 32
// elements, the row stride apart); the query tile, its 32-element slices as element pairs, is
// tile B; the product is a [token][head] tile of scores.
// P.V: tile B wants token pairs, and V rows are single tokens, so a tile of V rows (loaded as they
// lie) pairs each row's elements (2d, 2d+1) instead, and P is given twice in one tile: rows [0, gt)
// hold each probability in the pair's first place (a zero in the second), rows [gt, 2 gt) in its
// second. The product's first rows sum p[t] v[t][2d], its last rows p[t] v[t][2d + 1]: the
// accumulators hold each 32-element chunk as its 16 even elements, then its 16 odd ones
// (vec.h's from_even_odd_order<16> puts them back). The P tiles of a chunk are written once, after
// its softmax (probability_pairs), so that no tile is loaded right after vector stores wrote it
// (that load waits ~80-100 cycles for the stores).
#pragma once

#if defined(__AMX_BF16__)
#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "cpu/row_prefetch.h"
#include "cpu/vec.h"

namespace minipaged {
namespace {

// Query heads per kv head the tiles take (one tile column each, two P rows each), and the longest row.
constexpr int64_t kAmxMaxGroup = 8;
constexpr int64_t kAmxMaxHeadDim = 256;

// The tiles of one work item (gt query heads per kv head): a configuration per phase of a chunk
// (Q.K, then P.V), loaded as the phase begins, and the tile state released when the item ends (it is
// per thread; releasing it keeps context switches cheap).
class AmxTiles {
 public:
  explicit AmxTiles(int64_t gt) : gt_(gt) {
    const auto head_bytes = static_cast<uint16_t>(4 * gt);
    // Q.K: 0 / 1 K slices (16 tokens x 32 elements), 2 / 3 query slices as pairs (16 pairs x gt),
    // 4 the scores (16 tokens x gt).
    scores_config_.set(0, 16, 64), scores_config_.set(1, 16, 64);
    scores_config_.set(2, 16, head_bytes), scores_config_.set(3, 16, head_bytes), scores_config_.set(4, 16, head_bytes);
    // P.V: 0 the probabilities in the pairs' first, then second place (2 gt x 16 pairs), 2 / 3 V
    // slices (16 tokens x 32), 4-7 four slices' sums (2 gt x 16: even elements, then odd).
    accumulate_config_.set(0, 2 * gt, 64);
    accumulate_config_.set(2, 16, 64), accumulate_config_.set(3, 16, 64);
    for (int tile = 4; tile < 8; ++tile) accumulate_config_.set(tile, 2 * gt, 64);
  }
  ~AmxTiles() { _tile_release(); }
  AmxTiles(const AmxTiles&) = delete;
  AmxTiles& operator=(const AmxTiles&) = delete;

  // The query tile q [gt, D] (bfloat16) as tile B's pairs: pairs[c][p][g] = (q[g][32c + 2p],
  // q[g][32c + 2p + 1]), one 32-bit word each.
  void query_pairs(const c10::BFloat16* q, int64_t D, uint32_t* pairs) const {
    for (int64_t g = 0; g < gt_; ++g)
      for (int64_t w = 0; w < D / 2; ++w) std::memcpy(&pairs[w * gt_ + g], q + g * D + 2 * w, 4);
  }

  // The scores q[g] . k[t] of the n rows of k (n <= block size; the rows past n in the last group
  // of 16 are read, inside the block, and their scores dropped later) as the tiles hold them:
  // [ceil(n / 16)][16 tokens][gt]. head_rows turns a chunk of them into rows per head afterwards:
  // read right after the tile store, they would wait ~80-100 cycles for it.
  void scores(const uint32_t* pairs, const c10::BFloat16* k, int64_t n, int64_t D, float* tiles, RowPrefetch& pf) {
    use(scores_config_);
    const int64_t slices = D / 32, pair_bytes = 4 * gt_, rows_per_pair = 32 / slices;  // prefetch pace
    for (int64_t t = 0; t < n; t += 16, tiles += 16 * gt_) {
      _tile_zero(4);
      for (int64_t c = 0; c < slices; c += 2) {
        pf.upto(t + rows_per_pair * (c / 2 + 1));
        _tile_loadd(0, k + t * D + 32 * c, 2 * D);
        _tile_loadd(2, pairs + 16 * gt_ * c, pair_bytes);
        _tile_loadd(1, k + t * D + 32 * c + 32, 2 * D);
        _tile_loadd(3, pairs + 16 * gt_ * (c + 1), pair_bytes);
        _tile_dpbf16ps(4, 0, 2);
        _tile_dpbf16ps(4, 1, 3);
      }
      _tile_stored(4, tiles, pair_bytes);
    }
  }

  // scores[g * stride + t] = scale * (q[g] . k[t]) for t < n, from what scores() stored.
  void head_rows(const float* tiles, float scale, int64_t n, float* scores, int64_t stride) const {
    for (int64_t t = 0; t < n; t += 16, tiles += 16 * gt_)
      to_head_rows(tiles, scale, std::min<int64_t>(16, n - t), scores + t, stride);
  }

  // The P tiles of n probabilities p[g * stride + t] of the tile's heads, rounded to bfloat16 (as on
  // the pair-dot-product path): for each group of 16 tokens, 2 gt rows of 16 pairs (see above), zero
  // past n. pairs: [ceil(n / 16)][2 gt][16].
  void probability_pairs(const float* p, int64_t stride, int64_t n, uint32_t* pairs) const {
    for (int64_t t = 0; t < n; t += 16, pairs += 2 * gt_ * 16)
      for (int64_t g = 0; g < gt_; ++g) {
        const __m256bh b = _mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(first_lanes(n - t), p + g * stride + t));
        const __m512i w = _mm512_cvtepu16_epi32((__m256i)b);
        _mm512_store_si512(pairs + g * 16, w);
        _mm512_store_si512(pairs + (gt_ + g) * 16, _mm512_slli_epi32(w, 16));
      }
  }

  // acc[g] (row stride D, even/odd order) += sum over t < n of p[g][t] * v[t], the P tiles of the n
  // tokens as probability_pairs wrote them.
  void accumulate(const uint32_t* pairs, const c10::BFloat16* v, int64_t n, int64_t D, float* acc, RowPrefetch& pf) {
    use(accumulate_config_);
    alignas(64) float sums[4][2 * kAmxMaxGroup * 16];  // [slice % 4][2 gt, 16]
    alignas(64) c10::BFloat16 staged[16 * kAmxMaxHeadDim];
    const int64_t slices = D / 32, rows_per_pair = 32 / slices;  // prefetch pace
    for (int64_t t = 0; t < n; t += 16, pairs += 2 * gt_ * 16) {
      const int64_t rows = std::min<int64_t>(16, n - t);
      _tile_loadd(0, pairs, 64);
      // A row past n may hold anything (NaN too, and 0 * NaN is NaN): the last group's rows are
      // copied, zeros after them.
      const c10::BFloat16* rows_v = v + t * D;
      if (rows < 16) {
        std::memcpy(staged, rows_v, rows * D * sizeof(c10::BFloat16));
        std::memset(staged + rows * D, 0, (16 - rows) * D * sizeof(c10::BFloat16));
        rows_v = staged;
      }
      // Fresh sums per group, four slices at a time, added to acc by the vector unit: a tile loaded
      // from acc right after being stored there waits ~80 cycles for the store.
      for (int64_t c0 = 0; c0 < slices; c0 += 4) {
        const int64_t c1 = std::min(c0 + 4, slices);  // slices is even (D % 64 == 0)
        for (int64_t c = c0; c < c1; c += 2) {
          pf.upto(t + rows_per_pair * (c / 2 + 1));
          _tile_loadd(2, rows_v + 32 * c, 2 * D);
          _tile_loadd(3, rows_v + 32 * c + 32, 2 * D);
          if (c == c0) {
            _tile_zero(4);
            _tile_zero(5);
            _tile_dpbf16ps(4, 0, 2);
            _tile_dpbf16ps(5, 0, 3);
          } else {
            _tile_zero(6);
            _tile_zero(7);
            _tile_dpbf16ps(6, 0, 2);
            _tile_dpbf16ps(7, 0, 3);
          }
        }
        _tile_stored(4, sums[0], 64);
        _tile_stored(5, sums[1], 64);
        if (c1 - c0 == 4) {
          _tile_stored(6, sums[2], 64);
          _tile_stored(7, sums[3], 64);
        }
        for (int64_t g = 0; g < gt_; ++g)
          for (int64_t c = c0; c < c1; ++c)
            for (int half = 0; half < 2; ++half) {
              float* a = acc + g * D + 32 * c + 16 * half;
              _mm512_storeu_ps(a, _mm512_add_ps(_mm512_loadu_ps(a), _mm512_load_ps(sums[c - c0] + (half * gt_ + g) * 16)));
            }
      }
    }
    pf.upto(pf.rows);
  }

 private:
  struct alignas(64) Config {
    uint8_t palette = 1, start_row = 0, reserved[14] = {};
    uint16_t colsb[16] = {};
    uint8_t rows[16] = {};
    void set(int tile, int64_t r, uint16_t bytes) { rows[tile] = static_cast<uint8_t>(r), colsb[tile] = bytes; }
  };
  // Loading a configuration clears the tiles; the phases of a chunk take turns.
  void use(const Config& config) {
    if (current_ == &config) return;
    _tile_loadconfig(&config);
    current_ = &config;
  }
  // The scores tile [token][head] (rows of gt) into rows of the scores, one per head, scaled.
  void to_head_rows(const float* tile, float scale, int64_t n, float* scores, int64_t stride) const {
    const __mmask16 live = first_lanes(n);
    const __m512 s = _mm512_set1_ps(scale);
    if (gt_ == 2) {
      const __m512 a = _mm512_load_ps(tile), b = _mm512_load_ps(tile + 16);
      const __m512i evens = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
      const __m512i odds = _mm512_add_epi32(evens, _mm512_set1_epi32(1));
      _mm512_mask_storeu_ps(scores, live, _mm512_mul_ps(s, _mm512_permutex2var_ps(a, evens, b)));
      _mm512_mask_storeu_ps(scores + stride, live, _mm512_mul_ps(s, _mm512_permutex2var_ps(a, odds, b)));
      return;
    }
    const __m512i tokens = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                              _mm512_set1_epi32(static_cast<int>(gt_)));
    for (int64_t g = 0; g < gt_; ++g) {
      const __m512 column = _mm512_i32gather_ps(_mm512_add_epi32(tokens, _mm512_set1_epi32(static_cast<int>(g))), tile, 4);
      _mm512_mask_storeu_ps(scores + g * stride, live, _mm512_mul_ps(s, column));
    }
  }
  int64_t gt_;
  Config scores_config_, accumulate_config_;
  const Config* current_ = nullptr;
};

}  // namespace
}  // namespace minipaged
#endif
