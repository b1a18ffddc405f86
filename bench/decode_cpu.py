"""CPU decode attention: minipaged's paged kernel against SDPA on the same K/V stored contiguously.

Defaults are Qwen3-0.6B's attention (16 query heads, 8 kv heads, head_dim 128), batch 8 x 2,048
tokens, float32, block 16, shuffled blocks. Everything is measured in one process, side by side,
and printed as ratios; absolute times on a shared machine are only indicative.

    python bench/decode_cpu.py                       # the headline case
    python bench/decode_cpu.py --dtype bfloat16
    python bench/decode_cpu.py --batch 1 --seq-len 32768
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
import minipaged_ops  # noqa: E402
from common import DTYPES, make_decode_problem, median_seconds, print_table, read_bandwidth, sdpa_decode  # noqa: E402


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--num-heads", type=int, default=16)
    ap.add_argument("--num-kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--dtype", choices=DTYPES, default="float32")
    ap.add_argument("--iters", type=int, default=30)
    args = ap.parse_args(argv)

    p = make_decode_problem(args.batch, args.seq_len, args.num_heads, args.num_kv_heads, args.head_dim,
                            args.block_size, DTYPES[args.dtype])
    paged = lambda: minipaged_ops.paged_attention_decode(p.query, p.key_cache, p.value_cache, p.block_tables,
                                                         p.seq_lens, p.scale)
    err = (paged().double() - sdpa_decode(p).double()).abs().max().item()
    read_bw = read_bandwidth()
    t_paged = median_seconds(paged, args.iters)
    t_sdpa = median_seconds(lambda: sdpa_decode(p), args.iters)
    gbs = lambda t: p.kv_bytes / t / 1e9
    print(f"decode: batch {args.batch} x {args.seq_len} tokens, heads {args.num_heads}/{args.num_kv_heads}/"
          f"{args.head_dim}, {args.dtype}, block {args.block_size}; K+V {p.kv_bytes / 2**20:.0f} MiB; "
          f"{torch.get_num_threads()} threads; max |paged - sdpa| = {err:.2e}")
    print(f"read bandwidth (large sum): {read_bw / 1e9:.1f} GB/s")
    rows = [
        dict(kernel="minipaged paged", ms=f"{t_paged * 1e3:.3f}", GBps=f"{gbs(t_paged):.1f}",
             pct_bw=f"{100 * p.kv_bytes / t_paged / read_bw:.0f}%", speedup_vs_sdpa=f"{t_sdpa / t_paged:.2f}x"),
        dict(kernel="sdpa contiguous", ms=f"{t_sdpa * 1e3:.3f}", GBps=f"{gbs(t_sdpa):.1f}",
             pct_bw=f"{100 * p.kv_bytes / t_sdpa / read_bw:.0f}%", speedup_vs_sdpa="1.00x"),
    ]
    print_table(rows, ["kernel", "ms", "GBps", "pct_bw", "speedup_vs_sdpa"])


if __name__ == "__main__":
    main()
