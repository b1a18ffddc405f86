"""CPU decode attention through every implementation that imports, on the same K/V and block tables,
in one process, timed in alternation with cold caches (bench/common.py), medians:

- minipaged: paged_attention_decode on the paged cache;
- FlexAttention (torch.compile'd on CPU) over the same pages: the blocks laid out as one physical
  token pool, every query one row, a block mask built from the block tables (block size = page);
- SDPA on contiguous K/V, GQA by `enable_gqa` and with the kv heads repeated beforehand;
- Intel Extension for PyTorch's paged decode (`single_query_cached_kv_attention`), when it imports
  (it needs torch 2.8 exactly: a side venv, below);
- the read roof: a `sum` over as many bytes as K+V.

Every output is checked against a float64 reference before timing. GB/s counts K+V bytes once.

    python bench/peers.py
    python bench/peers.py --dtype bfloat16 --batch 1 --seq-len 32768 --out bench/out

IPEX's side venv, from the repository root (minipaged builds against torch 2.8 with --no-deps;
build-dir keeps this build apart from the main venv's; PyPI's torch 2.8.0 is a CUDA build that
brings ~3 GB of nvidia wheels, and this build of minipaged is CPU-only unless nvcc has its CUDA major):

    python3 -m venv .venv-ipex
    .venv-ipex/bin/pip install torch==2.8.0
    .venv-ipex/bin/pip install "intel-extension-for-pytorch==2.8.*" numpy tqdm matplotlib scikit-build-core "cmake>=3.26" ninja
    .venv-ipex/bin/pip install --no-build-isolation --no-deps -C build-dir=build/ipex -e .
    .venv-ipex/bin/python bench/peers.py

In that venv the FlexAttention row is left out (torch 2.8's inductor emits C++ that g++ 12 rejects)
and SDPA is torch 2.8's.
"""

from __future__ import annotations

import argparse
import csv
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(__file__))
import minipaged_ops  # noqa: E402
from common import (DTYPES, DecodeProblem, add_cpu_decode_args, busy_core, cpu_decode_problem,  # noqa: E402
                    interleaved_medians, machine_name, print_table)

TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 3e-2, torch.float16: 5e-3}


def reference(p: DecodeProblem) -> torch.Tensor:
    """float64 attention over the contiguous K/V (every sequence has seq_len tokens here)."""
    group = p.query.size(1) // p.key.size(1)
    k = p.key.double().repeat_interleave(group, dim=1)
    v = p.value.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("bhd,bhtd->bht", p.query.double(), k) * p.scale
    return torch.einsum("bht,bhtd->bhd", scores.softmax(-1), v)


def sdpa_gqa(p: DecodeProblem):
    return lambda: torch.nn.functional.scaled_dot_product_attention(
        p.query.unsqueeze(2), p.key, p.value, scale=p.scale, enable_gqa=True).squeeze(2)


def sdpa_repeated(p: DecodeProblem):
    group = p.query.size(1) // p.key.size(1)
    key, value = p.key.repeat_interleave(group, dim=1), p.value.repeat_interleave(group, dim=1)  # not timed
    return lambda: torch.nn.functional.scaled_dot_product_attention(
        p.query.unsqueeze(2), key, value, scale=p.scale).squeeze(2)


def flex_paged(p: DecodeProblem):
    """FlexAttention over the pages: K/V as one pool [1, kv_heads, num_blocks * block, D] (the
    same blocks, token-major per head), queries as the rows of one batch, and a block mask whose
    KV blocks are the pages, so each query row visits exactly its sequence's pages."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    num_blocks, kv_heads, block, dim = p.key_cache.shape
    num_seqs = p.query.size(0)
    pool_k = p.key_cache.permute(1, 0, 2, 3).reshape(1, kv_heads, num_blocks * block, dim).contiguous()
    pool_v = p.value_cache.permute(1, 0, 2, 3).reshape(1, kv_heads, num_blocks * block, dim).contiguous()
    owner = torch.full((num_blocks,), -1, dtype=torch.int64)  # which sequence holds each page
    logical = torch.zeros(num_blocks, dtype=torch.int64)      # and at which position of its table
    for s in range(num_seqs):
        pages = p.block_tables[s].long()
        owner[pages] = s
        logical[pages] = torch.arange(pages.numel())
    q_rows = -(-num_seqs // 8) * 8  # rows padded to a multiple of 8; the extra rows see nothing
    seq_lens = torch.zeros(q_rows, dtype=torch.int64)
    seq_lens[:num_seqs] = p.seq_lens.long()

    def mask_mod(b, h, q_idx, kv_idx):
        page = kv_idx // block
        return (owner[page] == q_idx) & (logical[page] * block + kv_idx % block < seq_lens[q_idx])

    mask = create_block_mask(mask_mod, 1, None, q_rows, num_blocks * block, device="cpu", BLOCK_SIZE=(q_rows, block))
    query = torch.zeros(1, p.query.size(1), q_rows, dim, dtype=p.query.dtype)
    query[0, :, :num_seqs] = p.query.transpose(0, 1)
    compiled = torch.compile(flex_attention)

    def run():
        out = compiled(query, pool_k, pool_v, block_mask=mask, scale=p.scale, enable_gqa=True)
        return out[0, :, :num_seqs].transpose(0, 1)
    return run


def ipex_paged(p: DecodeProblem):
    """IPEX 2.8's public paged decode; its cache layout [num_blocks, kv_heads, block, head_dim] is
    ours, so it reads the same pages. The raw torch_ipex op has no argument defaults (15 of them),
    so the module wrapper is the stable entry point."""
    import intel_extension_for_pytorch as ipex

    num_blocks, kv_heads, block, dim = p.key_cache.shape
    out = torch.empty_like(p.query)
    head_mapping = torch.arange(kv_heads, dtype=torch.int32).repeat_interleave(p.query.size(1) // kv_heads)
    max_len = int(p.seq_lens.max())
    decode = ipex.llm.modules.PagedAttention.single_query_cached_kv_attention

    def run():
        decode(out, p.query, p.key_cache, p.value_cache, head_mapping, p.scale, p.block_tables, p.seq_lens,
               block, max_len, None)
        return out
    return run


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_cpu_decode_args(ap)
    ap.add_argument("--dtype", default="float32", choices=list(DTYPES))
    ap.add_argument("--busy", action="store_true", help="time while another process spins on one core")
    ap.add_argument("--out", type=Path, default=None, help="folder for peers_<dtype>.csv and .png")
    args = ap.parse_args(argv)
    p = cpu_decode_problem(args, DTYPES[args.dtype])
    ref = reference(p)
    builders = {
        "minipaged paged": lambda p: lambda: minipaged_ops.paged_attention_decode(
            p.query, p.key_cache, p.value_cache, p.block_tables, p.seq_lens, p.scale),
        "flex_attention paged (compiled)": flex_paged,
        "sdpa contiguous, enable_gqa": sdpa_gqa,
        "sdpa contiguous, heads repeated": sdpa_repeated,
        "ipex paged decode": ipex_paged,
    }
    fns, notes = {}, []
    for name, build in builders.items():
        try:
            fn = build(p)
            err = (fn().double() - ref).abs().max().item()
        except Exception as exc:  # a peer that does not import or run here is reported, not timed
            notes.append(f"{name}: left out ({type(exc).__name__}: {str(exc).splitlines()[0][:120]})")
            continue
        if not err <= TOLERANCE[p.query.dtype]:
            notes.append(f"{name}: left out, wrong output (max |out - float64 reference| = {err:.1e})")
            continue
        fns[name] = fn
        notes.append(f"{name}: max |out - float64 reference| = {err:.1e}")
    roof = torch.ones(p.kv_bytes // 4, dtype=torch.float32)
    fns["read roof (sum, same bytes)"] = roof.sum
    with busy_core(args.busy):
        t = interleaved_medians(fns, args.iters)
    roof_bw = p.kv_bytes / t["read roof (sum, same bytes)"]
    ours = t.get("minipaged paged")
    print(f"{machine_name()}; torch {torch.__version__}; minipaged CPU variant {minipaged_ops.cpu_isa()}"
          + ("; BUSY (another process spinning on a core)" if args.busy else ""))
    print(f"decode: batch {args.batch} x {args.seq_len}, heads {args.num_heads}/{args.num_kv_heads}/{args.head_dim}, "
          f"block {args.block_size}, {args.dtype}, shuffled blocks; K+V {p.kv_bytes / 2**20:.0f} MiB; "
          f"median of {args.iters}, cold caches, in alternation")
    for n in notes:
        print("  " + n)
    rows = [dict(kernel=name, ms=f"{sec * 1e3:.3f}", GBps=f"{p.kv_bytes / sec / 1e9:.1f}",
                 of_roof=f"{p.kv_bytes / sec / roof_bw:.2f}",
                 vs_minipaged=f"{ours / sec:.2f}x" if ours else "-") for name, sec in t.items()]
    print_table(rows, ["kernel", "ms", "GBps", "of_roof", "vs_minipaged"])
    print("vs_minipaged: that row's speed as a multiple of minipaged's (below 1: slower)")
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        stem = args.out / f"peers_{args.dtype}_{args.batch}x{args.seq_len}"
        with open(stem.with_suffix(".csv"), "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(figsize=(8, 0.6 * len(rows) + 1.5))
        ax.barh([r["kernel"] for r in rows][::-1], [float(r["GBps"]) for r in rows][::-1], color="tab:blue")
        ax.set_xlabel("GB/s of K+V (higher is better)")
        ax.set_title(f"decode {args.batch} x {args.seq_len}, {args.dtype}\n{machine_name()}", fontsize=9)
        fig.tight_layout()
        fig.savefig(stem.with_suffix(".png"), dpi=110)
        print(f"wrote {stem}.csv and {stem}.png")


if __name__ == "__main__":
    main()
