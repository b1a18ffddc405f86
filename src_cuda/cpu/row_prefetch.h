// The prefetch stream of the CPU attention kernels: lines asked for a few at a time as rows are
// computed. Anonymous namespace for the reason vec.h gives.
#pragma once

#include <algorithm>
#include <cstdint>
#include <limits>

namespace minipaged {
namespace {

// Into L2 (prefetcht2), not L1: an L1 prefetch holds one of the core's few L1 miss buffers until
// its line arrives from memory, so a stream far enough ahead to cover memory latency stalls the
// kernel's own loads; L2 tracks many more misses, and a line moves from L2 to L1 in a few cycles
// (bench/RESULTS.md: int8 decode from 51-58% of a sum's speed to 72-80% on one thread, 50-76% to
// 71-82% on two).
// always_inline, as every helper that only prefetches: GCC counts prefetches as no side effect, so
// it may drop a call to such a function once it also reads a global (seen: an early return on a
// global flag removed every page touch of the decode kernel).
__attribute__((always_inline)) inline void prefetch(const char* p, int64_t bytes) {
  for (int64_t i = 0; i < bytes; i += 64) __builtin_prefetch(p + i, 0, 1);
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

  // Whether every row has been asked for (upto does nothing more).
  bool finished() const { return done >= rows; }

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

}  // namespace
}  // namespace minipaged
