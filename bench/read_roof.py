"""How close CPU paged decode comes to simply reading its K/V: the kernel against plain read loops
over the same bytes, in the same order, with no arithmetic, timed side by side.

A large `sum` over contiguous memory (decode_cpu.py's roof) is the machine's best case. Paged
decode cannot read that way: it walks each sequence's blocks in table order, a chunk of blocks at
a time: their K runs (a block's K rows, every kv head, are one run), then their V runs. This compiles
a small C reader (cc + OpenMP, at first use) that does a block-by-block walk (each block's K run,
then its V run) with and without software prefetches, and the kernel's own walk (its reading
order and all its prefetches, no arithmetic), so the kernel's cost can be split into "the access
pattern" and "the kernel itself". The kernel also runs on tables whose
every entry names one of 4 blocks (its arithmetic with no memory traffic), and the `overlap:` line
says how much of that arithmetic the kernel hides under its reads, and the `ceiling:` line how much
the kernel's walk hides of as much arithmetic (its in-cache time) as plain independent
multiply-adds on each line: what this machine allows a loop with nothing else in it; the `arithmetic:` line sets its
in-cache multiply-adds per second against this machine's peak (float32 multiply-adds on every
thread; bfloat16 pair dot products too for --dtype bfloat16): how much a faster inner loop could
gain at most. Last, the kernel runs on the same blocks laid out back to back (each sequence's K runs
one after another, as contiguous K/V lie) and in order with a block-sized gap after each: the `layout:` line says what the shuffling costs, and
whether it is the order of the runs or that they are apart.

    python bench/read_roof.py
    python bench/read_roof.py --dtype bfloat16 --threads 1
    python bench/read_roof.py --fmas 4    # the read loops with some compute per line
    python bench/read_roof.py --fmas 8 --independent   # as much compute as the kernel, throughput-bound
    python bench/read_roof.py --also-block-sizes 64    # the kernel and its walk with blocks of 64 too
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import os
import subprocess
import sys
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(__file__))
import minipaged_ops  # noqa: E402
from common import (DTYPES, add_cpu_decode_args, cpu_decode_problem, interleaved_medians, machine_name,  # noqa: E402
                    make_decode_problem, print_table)

IN_CACHE_READ = "read, the kernel's walk, every table entry one of 4 blocks (in cache)"
IN_CACHE = "minipaged, every table entry one of 4 blocks (in cache)"
BACK_TO_BACK = "minipaged, the same blocks back to back"
GAPPED = "minipaged, the same blocks in order, a block's gap after each"
PLAIN_WALK = "read, the kernel's walk, no multiply-adds"
PARTITION_TOKENS = 512  # the kernel's work items: kPartitionTokens in src_cuda/cpu/kernels.cpp
CHUNK_SCORE_BYTES = 32 << 10  # the kernel's chunks of blocks: kChunkScoreBytes there

READER = r"""
#include <stdint.h>
#include <omp.h>
typedef uint64_t u64x8 __attribute__((vector_size(64), aligned(8)));

typedef float f32x16 __attribute__((vector_size(64), aligned(8)));
static int fmas = 0, chains = 2;  /* set by set_fmas() */
void set_fmas(int n, int c) { fmas = n; chains = c; }

/* OR of every 64-byte line in [p, p + bytes): a read the compiler cannot drop, with no
   arithmetic worth the name; or, after set_fmas(n, 2), n dependent multiply-adds on each line
   (two chains: latency-bound, like a kernel waiting on its own results), or with set_fmas(n, 8)
   the same multiply-adds spread over eight independent chains (throughput-bound, as a kernel's
   tiles are). With `next` and ahead == 0, each line of the same region of the next block is
   prefetched as the matching line is read; with ahead > 0, the line `ahead` bytes further on in
   reading order (past the end of this region: `next`). */
static u64x8 read_region(const char* p, const char* next, int64_t bytes, int64_t ahead) {
    u64x8 a = {0}, b = {0};
    f32x16 fa = {0}, fb = {0}, c[8] = {{0}};
    const f32x16 q = fa + 0.999f;
    for (int64_t i = 0; i < bytes; i += 128) {
        if (ahead > 0) {
            const int64_t j = i + ahead;
            const char* at = j < bytes ? p + j : next ? next + (j - bytes) : 0;
            if (at) { __builtin_prefetch(at); __builtin_prefetch(at + 64); }
        } else if (next) { __builtin_prefetch(next + i); __builtin_prefetch(next + i + 64); }
        if (fmas == 0) {
            a |= *(const u64x8*)(p + i);
            b |= *(const u64x8*)(p + i + 64);
        } else if (chains == 2) {
            const f32x16 x = *(const f32x16*)(p + i), y = *(const f32x16*)(p + i + 64);
            for (int w = 0; w < fmas; ++w) { fa = fa * q + x; fb = fb * q + y; }
        } else {
            const f32x16 x = *(const f32x16*)(p + i), y = *(const f32x16*)(p + i + 64);
            for (int w = 0; w < 2 * fmas; w += 8)
                for (int j = 0; j < 8; ++j) c[j] = c[j] * q + (j % 2 ? y : x);
        }
    }
    for (int j = 0; j < 8; ++j) fa += c[j];
    return a | b | (u64x8)(fa + fb);
}

/* Run r of the work item [j0, j1) in the kernel's reading order: chunks of `per_chunk` blocks,
   each chunk's K runs, then its V runs. */
static const char* kernel_run(const char* k, const char* v, const int32_t* table, int64_t block_bytes,
                              int64_t j0, int64_t j1, int64_t per_chunk, int64_t r) {
    const int64_t c0 = j0 + r / (2 * per_chunk) * per_chunk, i = r - 2 * (c0 - j0);
    const int64_t n = j1 - c0 < per_chunk ? j1 - c0 : per_chunk;
    return (i < n ? k : v) + table[c0 + i % n] * block_bytes;
}

/* The paged walk: work items of `per_item` blocks (the kernel's 512 tokens), blocks in table
   order. prefetch 0-3: per block, its K rows (every kv head: one run), then its V rows (one run);
   1: the next block's rows asked for alongside; 2: the next run in reading order (this block's V,
   then the next block's K); 3: 4 KiB ahead in reading order, into the next run at the end of this
   one. prefetch 4, the kernel's own walk: its reading order (kernel_run), lines 4 KiB ahead, and
   as each run begins one line of every 4 KiB page of the next run into L2 (touch_pages in
   src_cuda/cpu/kernels.cpp). */
uint64_t read_paged(const char* k, const char* v, const int32_t* tables, int64_t num_seqs,
                    int64_t blocks_per_seq, int64_t block_bytes, int prefetch, int threads, int64_t per_item,
                    int64_t per_chunk) {
    uint64_t out = 0;
    const int64_t parts = (blocks_per_seq + per_item - 1) / per_item;
    #pragma omp parallel for num_threads(threads) schedule(dynamic, 1) reduction(|:out)
    for (int64_t item = 0; item < num_seqs * parts; ++item) {
        const int64_t s = item / parts, j0 = item % parts * per_item;
        const int64_t j1 = j0 + per_item < blocks_per_seq ? j0 + per_item : blocks_per_seq;
        const int32_t* table = tables + s * blocks_per_seq;
        u64x8 acc = {0};
        if (prefetch == 4) {
            const int64_t runs = 2 * (j1 - j0);
            const char* run = kernel_run(k, v, table, block_bytes, j0, j1, per_chunk, 0);
            for (int64_t r = 0; r < runs; ++r) {
                const char* next = r + 1 < runs ? kernel_run(k, v, table, block_bytes, j0, j1, per_chunk, r + 1) : 0;
                if (next) for (int64_t o = 0; o < block_bytes; o += 4096) __builtin_prefetch(next + o, 0, 1);
                acc |= read_region(run, next, block_bytes, 4096);
                run = next;
            }
        } else {
            for (int64_t j = j0; j < j1; ++j) {
                const int64_t off = table[j] * block_bytes, nb = prefetch && j + 1 < j1 ? table[j + 1] : -1;
                const char* next_k = nb >= 0 ? k + nb * block_bytes : 0;
                const char* next_v = nb >= 0 ? v + nb * block_bytes : 0;
                const int64_t ahead = prefetch == 3 ? 4096 : 0;
                acc |= read_region(k + off, prefetch >= 2 ? v + off : next_k, block_bytes, ahead);
                acc |= read_region(v + off, prefetch >= 2 ? next_k : next_v, block_bytes, ahead);
            }
        }
        for (int i = 0; i < 8; ++i) out |= acc[i];
    }
    return out;
}

/* The core's multiply-add ceiling, every thread at once: CHAINS independent chains of multiply-adds
   on the widest native vector (throughput-bound), `rounds` rounds per chain; with bf16 != 0,
   bfloat16 pair dot products instead (32 multiply-adds each; AVX512-BF16 only, else returns 0).
   Multiply-adds/s. The chains must all live in registers: 16 chains of 16 floats are 16 zmm on
   AVX-512 but 32 ymm on AVX2, which has 16, so there each multiply-add also spilled and reloaded
   its chain (4.4 G/s on two Zen 3 cores, a tenth of their peak). AVX2 takes 8-float vectors and 12
   chains (12 of the 16 ymm, beside q and y; 8 in flight cover a 4-cycle FMA latency at 2 a cycle). */
#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif
#if defined(__AVX512F__)
typedef float fvec __attribute__((vector_size(64)));
#define CHAINS 16
#else
typedef float fvec __attribute__((vector_size(32)));
#define CHAINS 12
#endif
double multiply_add_rate(int threads, int64_t rounds, int bf16) {
#if !defined(__AVX512BF16__)
    if (bf16) return 0;
#endif
    double seconds = 0;
    #pragma omp parallel num_threads(threads) reduction(max:seconds)
    {
        fvec c[CHAINS], x = {0}, sink = {0};
        for (int j = 0; j < CHAINS; ++j) c[j] = x + 1e-3f * j;
        const fvec q = x + 0.999f, y = x + 1e-3f;
        #pragma omp barrier
        const double t0 = omp_get_wtime();
        if (!bf16) {
            for (int64_t r = 0; r < rounds; ++r)
                for (int j = 0; j < CHAINS; ++j) c[j] = c[j] * q + y;
        }
#if defined(__AVX512BF16__)
        else {
            __m512 a[CHAINS];
            for (int j = 0; j < CHAINS; ++j) a[j] = (__m512)c[j];
            const __m512bh u = (__m512bh)_mm512_set1_epi32(0x3f803f80);
            for (int64_t r = 0; r < rounds; ++r)
                for (int j = 0; j < CHAINS; ++j) a[j] = _mm512_dpbf16_ps(a[j], u, u);
            for (int j = 0; j < CHAINS; ++j) c[j] = (fvec)a[j];
        }
#endif
        seconds = omp_get_wtime() - t0;
        for (int j = 0; j < CHAINS; ++j) sink += c[j];
        if (sink[0] == 12345.f) seconds += 1e-9;  /* keeps the chains alive */
    }
    const int lanes = sizeof(fvec) / sizeof(float);
    return (double)threads * rounds * CHAINS * (bf16 ? 2 * lanes : lanes) / seconds;
}

/* The same bytes read front to back, K then V, split evenly across threads. */
uint64_t read_contiguous(const char* k, const char* v, int64_t bytes, int threads) {
    uint64_t out = 0;
    #pragma omp parallel num_threads(threads) reduction(|:out)
    {
        const int t = omp_get_thread_num(), n = omp_get_num_threads();
        const int64_t chunk = bytes / n / 128 * 128, lo = t * chunk, hi = t == n - 1 ? bytes : lo + chunk;
        u64x8 acc = read_region(k + lo, 0, hi - lo, 0) | read_region(v + lo, 0, hi - lo, 0);
        for (int i = 0; i < 8; ++i) out |= acc[i];
    }
    return out;
}
"""


def load_reader() -> ctypes.CDLL:
    out = Path(__file__).resolve().parent / "out"
    out.mkdir(exist_ok=True)
    lib = out / f"read_roof_{hashlib.sha1(READER.encode()).hexdigest()[:12]}.so"
    if not lib.exists():
        src = lib.with_suffix(".c")
        src.write_text(READER)
        cc = os.environ.get("CC", "cc")
        subprocess.run([cc, "-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", str(src), "-o", str(lib)],
                       check=True)
    dll = ctypes.CDLL(str(lib))
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    dll.read_paged.argtypes = [ptr, ptr, ptr, i64, i64, i64, ctypes.c_int, ctypes.c_int, i64, i64]
    dll.read_paged.restype = ctypes.c_uint64
    dll.read_contiguous.argtypes = [ptr, ptr, i64, ctypes.c_int]
    dll.read_contiguous.restype = ctypes.c_uint64
    dll.set_fmas.argtypes = [ctypes.c_int, ctypes.c_int]
    dll.multiply_add_rate.argtypes = [ctypes.c_int, i64, ctypes.c_int]
    dll.multiply_add_rate.restype = ctypes.c_double
    return dll


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_cpu_decode_args(ap)
    ap.add_argument("--dtype", default="float32", choices=list(DTYPES))
    ap.add_argument("--fmas", type=int, default=0,
                    help="multiply-adds per 64-byte line in the read loops (default 0: plain reads); with some, "
                         "the reads show whether this machine overlaps that much compute with the walk")
    ap.add_argument("--independent", action="store_true",
                    help="spread --fmas over eight independent chains (throughput-bound, as the kernel's tiles are) "
                         "instead of two dependent ones (latency-bound)")
    ap.add_argument("--also-block-sizes", default="",
                    help="comma separated: also time the kernel and its walk on pools with these block "
                         "sizes (same shape, shuffled), in the same alternation: what the block size costs")
    args = ap.parse_args(argv)
    other_sizes = [int(b) for b in args.also_block_sizes.split(",") if b]
    for bs in [args.block_size, *other_sizes]:
        if args.seq_len % bs:
            ap.error(f"--seq-len: must be a multiple of every block size here, {bs} included "
                     "(the reader walks whole blocks)")
    p = cpu_decode_problem(args, DTYPES[args.dtype])
    threads = torch.get_num_threads()
    reader = load_reader()
    reader.set_fmas(args.fmas, 8 if args.independent else 2)

    def paged_read(problem, prefetch: int, pool=None):
        """The C walk over `problem`'s pool, or over `pool` (key_cache, value_cache, block_tables);
        prefetch 4 is the kernel's own walk (see READER)."""
        key_cache, value_cache, tables = pool or problem.pool
        tables = tables.contiguous()
        _, heads, block_size, head_dim = key_cache.shape
        block_bytes = heads * block_size * head_dim * key_cache.element_size()
        per_item = max(1, PARTITION_TOKENS // block_size)
        per_chunk = max(1, CHUNK_SCORE_BYTES // (args.num_heads * block_size * 4))
        kc, vc = key_cache.data_ptr(), value_cache.data_ptr()
        return lambda: reader.read_paged(kc, vc, tables.data_ptr(), args.batch, tables.size(1), block_bytes, prefetch,
                                         threads, per_item, per_chunk)

    def decode(problem, pool=None):
        """The kernel on `problem`, or on `pool` (key_cache, value_cache, block_tables) instead of its own."""
        key_cache, value_cache, tables = pool or problem.pool
        return lambda: minipaged_ops.paged_attention_decode(problem.query, key_cache, value_cache, tables,
                                                            problem.seq_lens, problem.scale)

    # The same blocks laid out differently: back to back (each sequence's K runs one after another,
    # as contiguous K/V would lie) and in order with a block-sized gap after each.
    back_to_back, gapped = p.relaid(1), p.relaid(2)
    expected = decode(p)()
    for pool in (back_to_back, gapped):
        assert torch.equal(decode(p, pool)(), expected), "a re-laid pool must decode to the same output"

    flat = torch.ones(p.kv_bytes // 4, dtype=torch.float32)
    kc, vc = p.key_cache.data_ptr(), p.value_cache.data_ptr()
    fns = {
        "minipaged paged_attention_decode": decode(p),
        "read, paged walk": paged_read(p, 0),
        "read, paged walk + prefetch next block": paged_read(p, 1),
        "read, paged walk + prefetch next run": paged_read(p, 2),
        "read, paged walk + prefetch 4 KiB ahead": paged_read(p, 3),
        "read, the kernel's walk (its order and prefetches)": paged_read(p, 4),
        IN_CACHE: decode(p, p.in_cache_pool),
        BACK_TO_BACK: decode(p, back_to_back),
        "read, the kernel's walk, blocks back to back": paged_read(p, 4, back_to_back),
        GAPPED: decode(p, gapped),
        "read, contiguous (same bytes)": lambda: reader.read_contiguous(kc, vc, p.kv_bytes // 2, threads),
        "torch sum, contiguous (same bytes)": flat.sum,
    }
    others = []  # kept alive while timed
    for bs in other_sizes:
        other = make_decode_problem(args.batch, args.seq_len, args.num_heads, args.num_kv_heads, args.head_dim, bs,
                                    DTYPES[args.dtype])
        others.append(other)
        fns[f"minipaged paged_attention_decode, block {bs}"] = decode(other)
        fns[f"read, the kernel's walk, block {bs}"] = paged_read(other, 4)
    # The ceiling for the overlap: the kernel's walk with as much arithmetic as the kernel has, as
    # plain multiply-adds in independent chains on each line (nothing else in the loop, no line
    # waiting on another). Its count per line is set so that the walk over the in-cache tables
    # takes the kernel's in-cache time (the time grows linearly with it).
    def with_fmas(n, fn):
        def run():
            reader.set_fmas(n, 8)
            try:
                return fn()
            finally:
                reader.set_fmas(args.fmas, 8 if args.independent else 2)
        return run

    walk_in_cache = paged_read(p, 4, p.in_cache_pool)
    probe = interleaved_medians({IN_CACHE: decode(p, p.in_cache_pool), 8: with_fmas(8, walk_in_cache),
                                 32: with_fmas(32, walk_in_cache)}, max(3, args.iters // 3))
    per_fma = max((probe[32] - probe[8]) / 24, 1e-12)
    ceiling_fmas = int(min(max(round(((probe[IN_CACHE] - probe[8]) / per_fma + 8) / 4) * 4, 4), 512))
    ceiling_cache = f"ceiling: the kernel's walk, {ceiling_fmas} independent multiply-adds per line (in cache)"
    ceiling = f"ceiling: the kernel's walk, {ceiling_fmas} independent multiply-adds per line"
    fns[ceiling_cache] = with_fmas(ceiling_fmas, walk_in_cache)
    fns[ceiling] = with_fmas(ceiling_fmas, paged_read(p, 4))
    fns[IN_CACHE_READ] = with_fmas(0, walk_in_cache)
    if args.fmas:
        fns[PLAIN_WALK] = with_fmas(0, paged_read(p, 4))
    t = interleaved_medians(fns, args.iters)
    # Every row above runs after a flush, and a call on a cold machine (dispatcher, code, page
    # walks) costs more than its arithmetic: the in-cache kernel once more, back to back.
    warm_compute = interleaved_medians({IN_CACHE: decode(p, p.in_cache_pool)}, args.iters, cold=False)[IN_CACHE]
    kernel = t["minipaged paged_attention_decode"]
    print(f"{machine_name()}; torch {torch.__version__}; {minipaged_ops.build_info()}")
    print(f"decode: batch {args.batch} x {args.seq_len}, heads {args.num_heads}/{args.num_kv_heads}/{args.head_dim}, "
          f"block {args.block_size}, {args.dtype}, shuffled blocks; K+V {p.kv_bytes / 2**20:.0f} MiB; "
          f"median of {args.iters}, all rows timed in alternation"
          + (f"; read loops with {args.fmas} multiply-adds per 64-byte line"
             + (" in 8 independent chains" if args.independent else " in 2 dependent chains") if args.fmas else ""))
    rows = [dict(what=name, ms=f"{sec * 1e3:.3f}", GBps=f"{p.kv_bytes / sec / 1e9:.1f}",
                 kernel_pct=f"{100 * sec / kernel:.0f}%") for name, sec in t.items()]
    print_table(rows, ["what", "ms", "GBps", "kernel_pct"])
    print("kernel_pct: the kernel's bytes/s as a share of that row's (100% = as fast as that read)")
    # If the kernel's arithmetic ran entirely under its reads, it would take as long as its walk;
    # if not at all, as long as the walk plus its in-cache time (the same work with no memory
    # traffic).
    walk, compute = t["read, the kernel's walk (its order and prefetches)"], t[IN_CACHE]
    print(f"overlap: the kernel takes {kernel * 1e3:.3f} ms; its walk {walk * 1e3:.3f} ms, its walk + in-cache time "
          f"{(walk + compute) * 1e3:.3f} ms: {100 * min(max((walk + compute - kernel) / compute, 0), 1):.0f}% of its "
          f"arithmetic hidden under its reads; in cache back to back (no flush) it takes {warm_compute * 1e3:.3f} ms, "
          f"{100 * min(max((walk + warm_compute - kernel) / warm_compute, 0), 1):.0f}% of that hidden")
    # The same sum for the ceiling loop, against the plain walk (no multiply-adds) whatever --fmas says.
    plain, synthetic = t[PLAIN_WALK] if args.fmas else walk, t[ceiling_cache]
    print(f"ceiling: the kernel's walk with {ceiling_fmas} independent multiply-adds per line takes "
          f"{synthetic * 1e3:.3f} ms in cache (the kernel {compute * 1e3:.3f}) and {t[ceiling] * 1e3:.3f} ms from memory; "
          f"the plain walk {plain * 1e3:.3f}: {100 * min(max((plain + synthetic - t[ceiling]) / synthetic, 0), 1):.0f}% "
          "of that arithmetic hidden, with nothing else in the loop")
    # The arithmetic's own ceiling: a decode step does 2 multiply-adds per K/V element per query
    # head (Q.K and P.V); in cache, against the most this machine's cores do (the best of a few
    # short runs, so a busy moment does not lower it).
    multiply_adds = 2 * args.batch * args.seq_len * args.num_heads * args.head_dim
    rates = {"float32 multiply-adds": max(reader.multiply_add_rate(threads, 1 << 21, 0) for _ in range(5))}
    if args.dtype == "bfloat16" and (pairs := max(reader.multiply_add_rate(threads, 1 << 20, 1) for _ in range(5))):
        rates["bfloat16 pair dot products"] = pairs
    in_cache_rate = multiply_adds / compute
    print(f"arithmetic: in cache the kernel does {in_cache_rate / 1e9:.1f} G multiply-adds/s; this machine's "
          + ", ".join(f"{what} peak at {rate / 1e9:.1f} G/s ({100 * in_cache_rate / rate:.0f}% of it)"
                      for what, rate in rates.items())
          + f"; reading the same cached bytes in its order takes {t[IN_CACHE_READ] * 1e3:.3f} ms, so the in-cache "
          f"time can shrink {compute / t[IN_CACHE_READ]:.2f}x at most")
    # Back to back, the blocks cost only what contiguous K/V would; in order with gaps, the runs are
    # as scattered as shuffled ones but still ascending.
    print(f"layout: the same blocks back to back take {100 * t[BACK_TO_BACK] / kernel:.0f}% of the kernel's time on "
          f"shuffled tables, in order with a gap after each {100 * t[GAPPED] / kernel:.0f}%; shuffling costs "
          f"{100 * (1 - t[BACK_TO_BACK] / kernel):.0f}% of it")


if __name__ == "__main__":
    main()
