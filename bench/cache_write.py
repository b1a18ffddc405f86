"""reshape_and_cache bandwidth: minipaged's cache write against the machine's copy bandwidth and a
plain PyTorch advanced-indexing write of the same data, measured in one run.

Defaults: 4,096 tokens, Qwen3-0.6B's kv heads (8 x 128), float32 and bfloat16, block 16, every
token to a distinct slot in shuffled order. Bytes moved count the key and value read once and
the same bytes written into the caches. Two roofs: a plain ``copy_`` of the same bytes timed in
the same alternation (``pct_of_same_copy``), and a large 1 GiB copy (``pct_large_copy_bw``), which
no cache helps.

    python bench/cache_write.py
    python bench/cache_write.py --tokens 16384 --dtypes bfloat16
    python bench/cache_write.py --device cuda
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
import minipaged_ops  # noqa: E402
from common import DTYPES, copy_bandwidth, interleaved_medians, machine_name, print_table  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--num-kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--dtypes", default="float32,bfloat16", help="comma list of " + ", ".join(DTYPES))
    ap.add_argument("--iters", type=int, default=None, help="timed runs (default 30 cpu, 100 cuda)")
    args = ap.parse_args(argv)
    args.dtypes = [d.strip() for d in args.dtypes.split(",")]
    for d in args.dtypes:
        if d not in DTYPES:
            ap.error(f"--dtypes: unknown {d!r}; expected some of {list(DTYPES)}")
    if args.iters is None:
        args.iters = 100 if args.device == "cuda" else 30
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA device visible")
    return args


def make_write_problem(args, dtype, seed=0):
    """key/value [tokens, kv_heads, head_dim], empty caches just large enough, shuffled distinct slots."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    num_blocks = -(-args.tokens // args.block_size)
    key = torch.randn(args.tokens, args.num_kv_heads, args.head_dim, generator=g).to(dtype)
    value = torch.randn(args.tokens, args.num_kv_heads, args.head_dim, generator=g).to(dtype)
    slot_mapping = torch.randperm(num_blocks * args.block_size, generator=g)[: args.tokens]
    key_cache = torch.zeros(num_blocks, args.num_kv_heads, args.block_size, args.head_dim, dtype=dtype)
    return [t.to(args.device) for t in (key, value, key_cache, key_cache.clone(), slot_mapping)]


def torch_write(key, value, key_cache, value_cache, slot_mapping):
    """The baseline: advanced-indexing writes (index_put_) of every token into its block and offset."""
    block_size = key_cache.shape[2]
    blocks, offsets = slot_mapping // block_size, slot_mapping % block_size
    key_cache[blocks, :, offsets] = key
    value_cache[blocks, :, offsets] = value


def check_same(args, dtype) -> None:
    """Both writers leave identical caches (the benchmark must time equal work)."""
    key, value, kc, vc, slots = make_write_problem(args, dtype)
    kc2, vc2 = kc.clone(), vc.clone()
    minipaged_ops.reshape_and_cache(key, value, kc, vc, slots)
    torch_write(key, value, kc2, vc2, slots)
    if not (torch.equal(kc, kc2) and torch.equal(vc, vc2)):
        raise RuntimeError(f"reshape_and_cache and the torch baseline disagree ({dtype})")


def measure(args, dtype_name: str, copy_bw: float) -> list[dict]:
    dtype = DTYPES[dtype_name]
    check_same(args, dtype)
    key, value, key_cache, value_cache, slot_mapping = make_write_problem(args, dtype)
    moved = 2 * 2 * key.numel() * key.element_size()  # (key + value) x (read + write)
    call = lambda fn: lambda: fn(key, value, key_cache, value_cache, slot_mapping)
    # The roof: a plain copy of the same bytes (key and value into buffers of their size).
    key_dst, value_dst = torch.empty_like(key), torch.empty_like(value)
    plain_copy = lambda: (key_dst.copy_(key), value_dst.copy_(value))
    t = interleaved_medians({"op": call(minipaged_ops.reshape_and_cache), "base": call(torch_write),
                             "copy": plain_copy}, args.iters, device=args.device)
    row = lambda kernel, sec: dict(dtype=dtype_name, kernel=kernel, MiB_moved=f"{moved / 2**20:.0f}",
                                   us=f"{sec * 1e6:.1f}", GBps=f"{moved / sec / 1e9:.1f}",
                                   pct_of_same_copy=f"{100 * t['copy'] / sec:.0f}%",
                                   pct_large_copy_bw=f"{100 * moved / sec / copy_bw:.0f}%",
                                   vs_baseline=f"{t['base'] / sec:.2f}x")
    return [row("minipaged reshape_and_cache", t["op"]), row("torch index_put_ (baseline)", t["base"]),
            row("copy_ of the same bytes (roof)", t["copy"])]


def main(argv=None) -> None:
    args = parse_args(argv)
    copy_bw = copy_bandwidth(args.device, nbytes=(2 << 30) if args.device == "cuda" else 1 << 30)
    print(f"{machine_name(args.device)}; torch {torch.__version__}; minipaged {minipaged_ops.build_info()}")
    print(f"reshape_and_cache: {args.tokens} tokens, kv heads {args.num_kv_heads} x {args.head_dim}, block "
          f"{args.block_size}, shuffled distinct slots; copy bandwidth (large copy_, read + write): "
          f"{copy_bw / 1e9:.1f} GB/s; median of {args.iters} runs")
    rows = [r for d in args.dtypes for r in measure(args, d, copy_bw)]
    print_table(rows, list(rows[0]))


if __name__ == "__main__":
    main()
