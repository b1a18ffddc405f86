"""Prefill attention: minipaged's paged_attention_prefill against what it replaces.

One sequence of ``history`` cached tokens plus ``new`` new ones (their K/V already in a shuffled
paged cache). Baselines, all on the same data:

  history == 0   SDPA, causal, on contiguous K/V (a fresh prompt: no cache read needed at all)
  history  > 0   gather + SDPA: copy the sequence's blocks into contiguous K/V, then SDPA with the
                 causal mask of the new tokens (the mask is built once, outside the timing)

Targets (issue 39, Qwen3-0.6B heads 16/8/128, the CPU default block size 64): fresh 1 x 2,048 prompt >= 1.0x SDPA;
2,048 cached + 256 new >= 1.5x gather + SDPA; float32 and bfloat16. Every output is checked
against the float64 reference before timing; every point is timed in alternation with its
baseline, caches cold (bench/common.py).

The cached-chunk target rows also time a compute roof in the same alternation: Q.K^T and P.V as
two dense torch.bmm calls in the same dtype, and for a 16-bit dtype in float32 too, the faster of
the two counting (a CPU without 16-bit dot products multiplies bfloat16 at a few GFLOP/s, and a
16-bit roof there would be no roof) (GQA groups folded into query rows, so one bmm per kv
head covers every head of its group; contiguous K/V, no softmax, no mask): what this CPU's GEMM
library (MKL / oneDNN through torch) does with these shapes. It computes every (row, key) pair,
the causal kernel only those on or below the diagonal, so the roof is the GEMMs' FLOP rate applied
to the causal FLOPs: roof_ms = bmm time x causal FLOPs / dense FLOPs. "of_roof" is roof_ms over a
system's time (1.0 = as fast as the GEMM library would be on the causal work alone).

    python bench/prefill.py                          # the two targets, float32 and bfloat16
    python bench/prefill.py --sweep --out bench/plots   # + history x new-token sweep, CSV + PNG
    python bench/prefill.py --isa all --block-size 64   # once per CPU variant this CPU runs (make bench-isas)
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import os
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402
from tqdm import tqdm  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
import minipaged_ops  # noqa: E402
from common import (DTYPES, add_isa_args, interleaved_medians, machine_name, make_decode_problem,  # noqa: E402
                    print_table, run_per_isa)
from minipaged_ops import reference  # noqa: E402

TARGETS = [(0, 2048, 1.0), (2048, 256, 1.5)]  # (history, new tokens, speedup wanted)
SWEEP_HISTORY = [0, 512, 2048, 4096]
SWEEP_NEW = [16, 128, 512]


def make_case(history, new, args, dtype, seed=0):
    """Paged cache + contiguous copy of one sequence (history + new tokens), new-token queries."""
    p = make_decode_problem(1, history + new, args.num_heads, args.num_kv_heads, args.head_dim, args.block_size,
                            dtype, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    query = torch.randn(new, args.num_heads, args.head_dim, generator=g).to(dtype)
    cu_seqlens_q = torch.tensor([0, new], dtype=torch.int32)
    return p, query, cu_seqlens_q


def kernels(p, query, cu_seqlens_q, history):
    """(paged op, baseline, the baseline's gather alone or None) as closures."""
    q4 = query.transpose(0, 1).unsqueeze(0)  # [1, heads, new, head_dim]
    sdpa = torch.nn.functional.scaled_dot_product_attention
    new = query.shape[0]

    def paged():
        return minipaged_ops.paged_attention_prefill(query, p.key_cache, p.value_cache, p.block_tables, cu_seqlens_q,
                                                     p.seq_lens, p.scale)

    if history == 0:
        def baseline():
            return sdpa(q4, p.key, p.value, is_causal=True, scale=p.scale, enable_gqa=True)[0].transpose(0, 1)
        gather = None
    else:
        seq_len = history + new
        mask = torch.arange(seq_len)[None, :] <= torch.arange(history, seq_len)[:, None]  # [new, seq_len]
        blocks = p.block_tables[0].long()

        def gather():
            k = p.key_cache[blocks].transpose(0, 1).flatten(1, 2)[:, :seq_len].unsqueeze(0)
            v = p.value_cache[blocks].transpose(0, 1).flatten(1, 2)[:, :seq_len].unsqueeze(0)
            return k, v

        def baseline():
            k, v = gather()
            return sdpa(q4, k, v, attn_mask=mask, scale=p.scale, enable_gqa=True)[0].transpose(0, 1)
    return paged, baseline, gather


def gemm_roof(p, query, history, dtype=None):
    """(two dense bmm calls doing Q.K^T and P.V for every head, in `dtype` (default: the query's),
    dense / causal FLOP ratio)."""
    if dtype is not None and dtype != query.dtype:
        p = dataclasses.replace(p, key=p.key.to(dtype), value=p.value.to(dtype))
        query = query.to(dtype)
    new, num_heads, head_dim = query.shape
    num_kv_heads = p.key.shape[1]
    group = num_heads // num_kv_heads
    # [kv head, new token x head of the group, head_dim]: the kernel's rows, GQA folded in.
    q = query.reshape(new, num_kv_heads, group, head_dim).permute(1, 0, 2, 3).reshape(num_kv_heads, new * group,
                                                                                       head_dim).contiguous()
    k_t = p.key[0].transpose(1, 2).contiguous()  # [kv head, head_dim, keys]
    v = p.value[0].contiguous()
    probs = torch.empty(num_kv_heads, new * group, history + new, dtype=query.dtype)
    out = torch.empty_like(q)

    def gemm():
        torch.bmm(q, k_t, out=probs)
        return torch.bmm(probs, v, out=out)

    causal_keys = sum(history + j + 1 for j in range(new))
    return gemm, new * (history + new) / causal_keys


def measure(history, new, dtype_name, args, roof=False):
    dtype = DTYPES[dtype_name]
    p, query, cu = make_case(history, new, args, dtype)
    paged, baseline, gather = kernels(p, query, cu, history)
    gemm, dense_over_causal = gemm_roof(p, query, history) if roof else (None, None)
    gemm32 = gemm_roof(p, query, history, torch.float32)[0] if roof and dtype != torch.float32 else None
    f64 = lambda t: t.double()  # noqa: E731
    expected = reference.paged_attention_prefill(f64(query), f64(p.key_cache), f64(p.value_cache), p.block_tables,
                                                 cu, p.seq_lens, p.scale)
    err = (paged().double() - expected).abs().max().item()
    base_err = (baseline().double() - expected).abs().max().item()
    tol = {"float32": 2e-5, "float16": 2e-3, "bfloat16": 1.6e-2}[dtype_name]
    if err > tol:
        raise SystemExit(f"paged_attention_prefill is off the reference by {err:.2e} (> {tol}) at history {history}, "
                         f"new {new}, {dtype_name}")
    fns = {"paged": paged, "baseline": baseline} | ({"gather": gather} if gather else {}) | (
        {"gemm": gemm} if gemm else {}) | ({"gemm32": gemm32} if gemm32 else {})
    t = interleaved_medians(fns, args.iters)
    roof = {}
    if gemm:
        roof_dtype = "float32" if gemm32 and t["gemm32"] < t["gemm"] else dtype_name
        roof_s = min(t["gemm"], t.get("gemm32", float("inf"))) / dense_over_causal
        causal_flops = 4 * args.num_heads * args.head_dim * sum(history + j + 1 for j in range(new))
        roof = dict(roof_dtype=roof_dtype, roof_ms=round(roof_s * 1e3, 3), roof_gflops=round(causal_flops / roof_s / 1e9, 1),
                    paged_of_roof=f"{roof_s / t['paged']:.0%}", baseline_of_roof=f"{roof_s / t['baseline']:.0%}")
    return roof | dict(dtype=dtype_name, history=history, new=new, baseline="sdpa causal" if history == 0 else "gather+sdpa",
                paged_ms=round(t["paged"] * 1e3, 3), baseline_ms=round(t["baseline"] * 1e3, 3),
                speedup=round(t["baseline"] / t["paged"], 2), max_err=f"{err:.1e}", baseline_err=f"{base_err:.1e}",
                gather_share=f"{t['gather'] / t['baseline']:.0%}" if gather else "-")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="float32,bfloat16", help="comma separated, of " + ", ".join(DTYPES))
    ap.add_argument("--num-heads", type=int, default=16)
    ap.add_argument("--num-kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own choice)")
    ap.add_argument("--sweep", action="store_true", help="also sweep history x new tokens")
    ap.add_argument("--out", default=None, help="folder for prefill_cpu.csv and prefill_cpu.png (with --sweep)")
    add_isa_args(ap)
    args = ap.parse_args(argv)
    if run_per_isa(args, argv):
        return
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    dtypes = args.dtype.split(",")
    if bad := [d for d in dtypes if d not in DTYPES]:
        ap.error(f"--dtype: unknown {bad}; expected {', '.join(DTYPES)}")

    print(f"prefill, heads {args.num_heads}/{args.num_kv_heads}/{args.head_dim}, block {args.block_size}, "
          f"shuffled blocks; {machine_name()}")
    # gather_share: the time of the baseline's gather alone over the whole baseline's.
    columns = ["dtype", "history", "new", "baseline", "paged_ms", "baseline_ms", "speedup", "gather_share", "max_err",
               "baseline_err"]
    rows = []
    for d in dtypes:
        for history, new, wanted in TARGETS:
            row = measure(history, new, d, args, roof=history > 0)
            row["target"] = f">= {wanted}x: {'met' if row['speedup'] >= wanted else 'NOT met'}"
            rows.append(row)
    print_table(rows, columns + ["target"])
    if roofs := [r for r in rows if "roof_ms" in r]:
        print("compute roof (dense torch.bmm Q.K^T + P.V in the same dtype or float32, the faster, scaled to the "
              "causal FLOPs; of_roof = roof time / system time):")
        print_table(roofs, ["dtype", "history", "new", "roof_dtype", "roof_ms", "roof_gflops", "paged_ms", "paged_of_roof",
                            "baseline_ms", "baseline_of_roof"])
    if not args.sweep:
        return

    points = [(d, h, n) for d in dtypes for h in SWEEP_HISTORY for n in SWEEP_NEW]
    sweep = [measure(h, n, d, args) for d, h, n in tqdm(points, desc="sweep", unit="point")]
    print_table(sweep, columns)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "prefill_cpu.csv"), "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=columns)
            w.writeheader()
            w.writerows(sweep)
        fig, axes = plt.subplots(1, len(dtypes), figsize=(5.5 * len(dtypes), 4), squeeze=False)
        for ax, d in zip(axes[0], dtypes):
            for n in SWEEP_NEW:
                pts = [r for r in sweep if r["dtype"] == d and r["new"] == n]
                ax.plot([r["history"] for r in pts], [r["speedup"] for r in pts], marker="o", label=f"{n} new tokens")
            ax.axhline(1.0, color="gray", lw=0.8)
            ax.set(title=f"{d}", xlabel="cached tokens (history)", ylabel="speedup vs baseline (x)")
            ax.legend()
        fig.suptitle(f"paged_attention_prefill vs SDPA (history 0) / gather + SDPA\n{machine_name()}, shared busy "
                     f"machine; heads {args.num_heads}/{args.num_kv_heads}/{args.head_dim}, block {args.block_size}",
                     fontsize=9)
        fig.tight_layout()
        fig.savefig(os.path.join(args.out, "prefill_cpu.png"), dpi=110)
        print(f"wrote {args.out}/prefill_cpu.csv and prefill_cpu.png")


if __name__ == "__main__":
    main()
