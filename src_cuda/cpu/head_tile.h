// The GQA head tile of the CPU attention kernels: GT query heads of one kv head, kept in registers
// while a block's K and V rows stream by, each row loaded once for all GT heads. Its paths live
// apart, one per arithmetic: float32 multiply-adds for every cache dtype and instruction set
// (tile_float.h), bfloat16 pair dot products (tile_bf16.h, AVX512-BF16) and 16-bit integer pair
// dot products for int8 caches (tile_int8.h, AVX512-VNNI and AVX2). The kernels pick one per call.
#pragma once

#include "cpu/tile_bf16.h"
#include "cpu/tile_float.h"
#include "cpu/tile_int8.h"

namespace minipaged {
namespace {

template <int GT>
struct HeadTile : FloatTile<GT>
#if defined(__AVX512BF16__)
    , Bf16Tile<GT>
#endif
#if defined(MINIPAGED_INT16_PAIRS)
    , Int8Tile<GT>
#endif
{
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

}  // namespace
}  // namespace minipaged
