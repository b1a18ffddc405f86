"""CPU decode attention: minipaged's paged kernel against SDPA on the same K/V stored contiguously.

Defaults are Qwen3-0.6B's attention (16 query heads, 8 kv heads, head_dim 128), batch 8 x 2,048
tokens, float32, block 16, shuffled blocks. Everything is measured in one process, side by side,
and printed as ratios; absolute times on a shared machine are only indicative.

    python bench/decode_cpu.py                       # the headline case
    python bench/decode_cpu.py --dtype float32,bfloat16   # per-byte comparison in one run
    python bench/decode_cpu.py --batch 1 --seq-len 32768
    python bench/decode_cpu.py --in-cache --threads 1    # the kernel's own cost, without memory
    python bench/decode_cpu.py --back-to-back --dtype float32,bfloat16   # without scattered blocks
    python bench/decode_cpu.py --busy --batch 2 --seq-len 512   # another process spinning on a core
    python bench/decode_cpu.py --kv-cache-dtype int8,fp8_e4m3,fp8_e5m2   # 8-bit caches vs bfloat16's
    python bench/decode_cpu.py --isa all --block-size 64   # once per CPU variant this CPU runs (make bench-isas)
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
import minipaged_ops  # noqa: E402
from common import (DTYPES, QuantizedPool, add_cpu_decode_args, add_isa_args, busy_core,  # noqa: E402
                    cpu_decode_problem, interleaved_times, median_ratio, print_table, run_per_isa, sdpa_decode)

KV_CACHE_DTYPES = ("int8", "fp8_e4m3", "fp8_e5m2")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_cpu_decode_args(ap)
    ap.add_argument("--dtype", default="float32",
                    help="one or more of " + ", ".join(DTYPES) + ", comma separated (all timed in one run)")
    ap.add_argument("--in-cache", action="store_true",
                    help="point every block-table entry at one of 4 blocks, so K/V stay in cache and the paged "
                         "kernel's compute cost shows (GB/s then counts the bytes it would have read; SDPA is "
                         "left out, having no such mode)")
    ap.add_argument("--back-to-back", action="store_true",
                    help="lay each sequence's blocks back to back in the pool (as contiguous K/V lie) instead of "
                         "shuffled: the same decode without the cost of scattered blocks")
    ap.add_argument("--busy", action="store_true",
                    help="time everything while another process spins on one core (a shared machine's load)")
    ap.add_argument("--kv-cache-dtype", default="",
                    help="8-bit caches to time beside the bfloat16 one, on the same blocks with the same bfloat16 "
                         "query: one or more of " + ", ".join(KV_CACHE_DTYPES) + ", comma separated (adds "
                         "bfloat16 to --dtype)")
    add_isa_args(ap)
    args = ap.parse_args(argv)
    if run_per_isa(args, argv):
        return
    dtypes = args.dtype.split(",")
    if bad := [d for d in dtypes if d not in DTYPES]:
        ap.error(f"--dtype: unknown {bad}; expected {', '.join(DTYPES)}")
    kv_dtypes = [k for k in args.kv_cache_dtype.split(",") if k]
    if bad := [k for k in kv_dtypes if k not in KV_CACHE_DTYPES]:
        ap.error(f"--kv-cache-dtype: unknown {bad}; expected {', '.join(KV_CACHE_DTYPES)}")
    if kv_dtypes and "bfloat16" not in dtypes:
        dtypes.append("bfloat16")

    if args.in_cache and args.back_to_back:
        ap.error("--in-cache and --back-to-back: choose one (in cache, the layout does not matter)")
    problems = {d: cpu_decode_problem(args, DTYPES[d]) for d in dtypes}
    fns, errors = {}, {}
    for d, p in problems.items():
        pool = p.relaid(1) if args.back_to_back else p.in_cache_pool if args.in_cache else p.pool
        fns["paged", d] = lambda p=p, pool=pool: minipaged_ops.paged_attention_decode(p.query, *pool, p.seq_lens,
                                                                                      p.scale)
        fns["sdpa", d] = lambda p=p: sdpa_decode(p)
        errors[d] = (fns["paged", d]().double() - fns["sdpa", d]().double()).abs().max().item()
        if args.in_cache:
            del fns["sdpa", d]
            errors[d] = float("nan")
    # 8-bit caches: the bfloat16 problem's K/V quantized on the same blocks (and tables).
    bf16 = problems.get("bfloat16")
    quantized = {}
    for k in kv_dtypes:
        pool = bf16.relaid(1) if args.back_to_back else bf16.in_cache_pool if args.in_cache else bf16.pool
        quantized[k] = QuantizedPool.of(pool, k, args.batch * args.seq_len)
        fns["paged", k] = lambda q=quantized[k]: q.decode(bf16)
        # Against the bfloat16 cache's output: the format's error, not the kernel's (the tests
        # check the kernel against the reference on the dequantized K/V).
        errors[k] = (fns["paged", k]().double() - fns["paged", "bfloat16"]().double()).abs().max().item()
    # The read roof of each row: a float32 sum over as many bytes as that row's K+V reads (its own
    # call and thread costs included, as the kernel's are), timed in the same alternation.
    kv_bytes = {**{d: p.kv_bytes for d, p in problems.items()}, **{k: q.kv_bytes for k, q in quantized.items()}}
    for nbytes in sorted(set(kv_bytes.values()), reverse=True):
        fns["sum", nbytes] = torch.ones(nbytes // 4, dtype=torch.float32).sum
    with busy_core(args.busy):
        times = interleaved_times(fns, args.iters, cold=not args.in_cache)
    t = {name: statistics.median(ts) for name, ts in times.items()}

    def share(kind, d):  # of the row's roof, median over rounds: memory drifts by half within minutes here
        return f"{100 * median_ratio(times, ('sum', kv_bytes[d]), (kind, d)):.0f}%"

    print(("IN-CACHE (every table entry names one of 4 blocks): " if args.in_cache else "")
          + ("BUSY (another process spinning on a core): " if args.busy else "")
          + f"decode: batch {args.batch} x {args.seq_len} tokens, heads {args.num_heads}/{args.num_kv_heads}/"
          f"{args.head_dim}, block {args.block_size}, {'blocks back to back' if args.back_to_back else 'shuffled blocks'}; "
          f"{torch.get_num_threads()} threads; "
          + "; ".join(f"{d}: K+V {p.kv_bytes / 2**20:.0f} MiB, max |paged - sdpa| = {errors[d]:.1e}"
                      for d, p in problems.items()))
    print("read bandwidth (a float32 sum over each row's bytes, timed alongside): "
          + ", ".join(f"{n / 2**20:.0f} MiB {n / t['sum', n] / 1e9:.1f} GB/s" for n in sorted(set(kv_bytes.values()))))
    if quantized:
        print("8-bit caches (same blocks, bfloat16 query; max |out - bfloat16 cache's out|): "
              + "; ".join(f"{k}: K+V {q.kv_bytes / 2**20:.0f} MiB with scales, {errors[k]:.1e}"
                          for k, q in quantized.items()))
    rows = []
    for d, p in problems.items():
        for name, kind in (("minipaged paged", "paged"), ("sdpa contiguous", "sdpa")):
            if (kind, d) not in t:
                continue
            sec = t[kind, d]
            rows.append(dict(dtype=d, kernel=name, ms=f"{sec * 1e3:.3f}", GBps=f"{p.kv_bytes / sec / 1e9:.1f}",
                             pct_read_bw=share(kind, d),
                             speedup_vs_sdpa=f"{t['sdpa', d] / sec:.2f}x" if ("sdpa", d) in t else "-"))
    for k, q in quantized.items():
        sec = t["paged", k]
        rows.append(dict(dtype=k, kernel="minipaged paged", ms=f"{sec * 1e3:.3f}", GBps=f"{q.kv_bytes / sec / 1e9:.1f}",
                         pct_read_bw=share("paged", k), speedup_vs_sdpa="-",
                         vs_bfloat16_cache=f"{median_ratio(times, ('paged', 'bfloat16'), ('paged', k)):.2f}x"))
    print_table(rows, ["dtype", "kernel", "ms", "GBps", "pct_read_bw", "speedup_vs_sdpa"]
                + (["vs_bfloat16_cache"] if quantized else []))
    per_byte = {d: problems[d].kv_bytes / t["paged", d] for d in problems}
    for d in ("bfloat16", "float16"):
        if d in per_byte and "float32" in per_byte:
            print(f"{d} / float32, paged bytes per second: {per_byte[d] / per_byte['float32']:.2f}")


if __name__ == "__main__":
    main()
