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
from common import DTYPES, interleaved_medians, make_decode_problem, print_table, sdpa_decode  # noqa: E402


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
    # The read roof: a sum over as many bytes as K and V hold, timed in the same alternation.
    roof_buf = torch.ones(p.kv_bytes // 4, dtype=torch.float32)
    t = interleaved_medians({"paged": paged, "sdpa": lambda: sdpa_decode(p), "sum": roof_buf.sum}, args.iters)
    read_bw = p.kv_bytes / t["sum"]
    print(f"decode: batch {args.batch} x {args.seq_len} tokens, heads {args.num_heads}/{args.num_kv_heads}/"
          f"{args.head_dim}, {args.dtype}, block {args.block_size}; K+V {p.kv_bytes / 2**20:.0f} MiB; "
          f"{torch.get_num_threads()} threads; max |paged - sdpa| = {err:.2e}")
    print(f"read bandwidth (sum over {p.kv_bytes / 2**20:.0f} MiB, timed alongside): {read_bw / 1e9:.1f} GB/s")
    rows = [dict(kernel=name, ms=f"{t[key] * 1e3:.3f}", GBps=f"{p.kv_bytes / t[key] / 1e9:.1f}",
                 pct_read_bw=f"{100 * t['sum'] / t[key]:.0f}%", speedup_vs_sdpa=f"{t['sdpa'] / t[key]:.2f}x")
            for name, key in (("minipaged paged", "paged"), ("sdpa contiguous", "sdpa"))]
    print_table(rows, ["kernel", "ms", "GBps", "pct_read_bw", "speedup_vs_sdpa"])

if __name__ == "__main__":
    main()
