"""GPU decode attention: minipaged against the device-to-device copy roof and SDPA (flash) on
contiguous K/V, in one process. Cold L2 between timed runs, CUDA events, median of many runs.

    python bench/decode_gpu.py                 # Qwen3-8B and Qwen3-0.6B heads, bf16, block 16
    python bench/decode_gpu.py --block-size 32
"""

from __future__ import annotations

import argparse
import csv
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
import minipaged_ops  # noqa: E402
from common import DTYPES, copy_bandwidth, interleaved_medians, make_decode_problem, print_table  # noqa: E402

# (label, num_heads, num_kv_heads, head_dim, batch, seq_len)
CASES = [
    ("Qwen3-8B", 32, 8, 128, 64, 4096),
    ("Qwen3-8B", 32, 8, 128, 1, 32768),
    ("Qwen3-0.6B", 16, 8, 128, 64, 4096),
    ("Qwen3-0.6B", 16, 8, 128, 1, 32768),
]


def sdpa_flash(p):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q = p.query.unsqueeze(2)
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        return torch.nn.functional.scaled_dot_product_attention(q, p.key, p.value, scale=p.scale,
                                                                enable_gqa=True).squeeze(2)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", choices=DTYPES, default="bfloat16")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--out", default=None, help="folder for decode_gpu.csv")
    args = ap.parse_args(argv)
    assert torch.cuda.is_available(), "this benchmark needs a CUDA device"

    copy_bw = copy_bandwidth("cuda", nbytes=2 << 30)
    print(f"{torch.cuda.get_device_name()}; torch {torch.__version__}; minipaged {minipaged_ops.build_info()}")
    print(f"device-to-device copy: {copy_bw / 1e9:.0f} GB/s (read + write)")
    rows = []
    for label, h, kv, d, batch, seq_len in CASES:
        p = make_decode_problem(batch, seq_len, h, kv, d, args.block_size, DTYPES[args.dtype], device="cuda")
        paged = lambda: minipaged_ops.paged_attention_decode(p.query, p.key_cache, p.value_cache, p.block_tables,
                                                             p.seq_lens, p.scale)
        err = (paged().float() - sdpa_flash(p).float()).abs().max().item()
        t = interleaved_medians({"paged": paged, "sdpa": lambda: sdpa_flash(p)}, args.iters, device="cuda")
        t_paged, t_sdpa = t["paged"], t["sdpa"]
        rows.append(dict(
            model=label, batch=batch, seq_len=seq_len, MiB=f"{p.kv_bytes / 2**20:.0f}",
            paged_us=f"{t_paged * 1e6:.1f}", paged_GBps=f"{p.kv_bytes / t_paged / 1e9:.0f}",
            pct_copy_bw=f"{100 * p.kv_bytes / t_paged / copy_bw:.0f}%",
            sdpa_us=f"{t_sdpa * 1e6:.1f}", sdpa_GBps=f"{p.kv_bytes / t_sdpa / 1e9:.0f}",
            speedup_vs_sdpa=f"{t_sdpa / t_paged:.2f}x", max_err=f"{err:.1e}"))
        del p
        torch.cuda.empty_cache()
    cols = list(rows[0])
    print_table(rows, cols)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "decode_gpu.csv"), "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=cols)
            w.writeheader()
            w.writerows(rows)


if __name__ == "__main__":
    main()
