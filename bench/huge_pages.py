"""CPU decode with the K/V pool in 2 MiB pages against the same pool in 4 KiB pages.

Paged decode reads each block's K and V as runs of tens of KiB at scattered addresses, so with
4 KiB pages nearly every run needs new TLB entries. This copies the pool into memory from
`minipaged_ops.allocate_kv_cache` (advised MADV_HUGEPAGE before first touch, which transparent
huge pages in `madvise` mode, the common default, honour; LLMEngine and PagedKVCache allocate
their pools with it) and times both pools, and the `sum` read probe over both kinds of pages, in
one process, alternating, cold caches. Same decode problem as decode_cpu.py.

    python bench/huge_pages.py
    python bench/huge_pages.py --threads 1 --iters 25

PyTorch's own switch for this is the environment variable THP_MEM_ALLOC_ENABLE=1 (its CPU
allocator then advises every allocation of 2 MiB or more), which must be set before torch starts.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
import minipaged_ops  # noqa: E402
from common import (DTYPES, add_cpu_decode_args, cpu_decode_problem, cpu_flush_bytes, machine_name,  # noqa: E402
                    print_table)

def huge_pages_kb() -> int:
    with open("/proc/self/smaps") as f:
        return sum(int(line.split()[1]) for line in f if line.startswith("AnonHugePages"))


def in_huge_pages(t: torch.Tensor) -> torch.Tensor:
    """A copy of `t` in memory advised for huge pages before it is first written (the library's
    pool allocator, which LLMEngine and PagedKVCache use)."""
    return minipaged_ops.allocate_kv_cache(t.shape, t.dtype).copy_(t)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_cpu_decode_args(ap)
    ap.add_argument("--dtype", default="float32,bfloat16", help="comma separated, of " + ", ".join(DTYPES))
    args = ap.parse_args(argv)
    fns, problems = {}, {}
    for d in args.dtype.split(","):
        p = problems[d] = cpu_decode_problem(args, DTYPES[d])
        before = huge_pages_kb()
        kh, vh = in_huge_pages(p.key_cache), in_huge_pages(p.value_cache)
        got = (huge_pages_kb() - before) / 1024
        for pages, (k, v) in (("4 KiB", (p.key_cache, p.value_cache)), ("2 MiB", (kh, vh))):
            fns[d, pages] = lambda p=p, k=k, v=v: minipaged_ops.paged_attention_decode(
                p.query, k, v, p.block_tables, p.seq_lens, p.scale)
        if not torch.equal(fns[d, "4 KiB"](), fns[d, "2 MiB"]()):
            raise AssertionError(f"{d}: the two pools gave different outputs")
        print(f"{d}: K+V {p.kv_bytes / 2**20:.0f} MiB, {got:.0f} MiB of it in huge pages")
    roof_bytes = max(p.kv_bytes for p in problems.values())
    plain = torch.ones(roof_bytes // 4)
    fns["sum", "4 KiB"], fns["sum", "2 MiB"] = plain.sum, in_huge_pages(plain).sum
    flush = torch.ones(cpu_flush_bytes() // 4)  # read before each timed run: cold caches
    for fn in fns.values():
        fn()
    times = {k: [] for k in fns}
    for _ in range(args.iters):
        for k, fn in fns.items():
            flush.sum()
            t0 = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - t0)
    t = {k: statistics.median(v) for k, v in times.items()}
    print(f"{machine_name()}; batch {args.batch} x {args.seq_len}, heads {args.num_heads}/{args.num_kv_heads}/"
          f"{args.head_dim}, block {args.block_size}, shuffled blocks; median of {args.iters}, alternating, cold caches")
    rows = []
    for d, nbytes in [*((d, p.kv_bytes) for d, p in problems.items()), ("sum", roof_bytes)]:
        for pages in ("4 KiB", "2 MiB"):
            bw = nbytes / t[d, pages]
            rows.append(dict(what="read probe (sum)" if d == "sum" else f"{d} decode", pages=pages,
                             ms=f"{t[d, pages] * 1e3:.3f}", GBps=f"{bw / 1e9:.1f}",
                             of_sum_same_pages=f"{bw / (roof_bytes / t['sum', pages]):.2f}",
                             huge_vs_4k=f"{t[d, '4 KiB'] / t[d, pages]:.2f}x"))
    print_table(rows, ["what", "pages", "ms", "GBps", "of_sum_same_pages", "huge_vs_4k"])


if __name__ == "__main__":
    main()
