"""Decode-attention sweeps: minipaged's paged kernel against SDPA on the same K/V stored contiguously.

Three sweeps, each point measured side by side in one process, against the device's bandwidth
roof measured once in the same run (CPU: a large ``sum``, reads only; GPU: device-to-device copy,
read + write, the figure of merit of bench/decode_gpu.py):

  context  seq_len 128, 256, ..., 32,768 at a fixed batch (--batch)
  batch    batch 1, 2, ..., 256 at a fixed context (--seq-len)
  block    block_size 8, 16, 32 at a fixed shape (--block-shape BATCHxSEQ_LEN)

Points whose K+V would exceed --max-kv-mib are skipped (and listed), so CPU runs stay bounded.
Writes ``sweep_<device>_<dtype>.csv`` (one row per point) and ``sweep_<device>_<dtype>.png`` to
--out, and prints a table.

    python bench/sweep.py --quick                          # CPU, float32, under a minute
    python bench/sweep.py --sweeps context                 # full context sweep only
    python bench/sweep.py --dtype bfloat16 --heads 16/8/128
    python bench/sweep.py --device cuda                    # H200: Qwen3-8B heads, bfloat16
"""

from __future__ import annotations

import argparse
import csv
import math
import os
import sys
import time

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402
from tqdm import tqdm  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
import minipaged_ops  # noqa: E402
from common import (DTYPES, copy_bandwidth, machine_name, make_decode_problem, interleaved_medians,  # noqa: E402
                    print_table, read_bandwidth, sdpa_decode)

SWEEPS = {
    "context": [2**i for i in range(7, 16)],   # seq_len 128 ... 32768
    "batch": [2**i for i in range(0, 9)],      # batch 1 ... 256
    "block": [8, 16, 32],                      # block_size
}
DEFAULTS = {
    "cpu": dict(dtype="float32", heads="16/8/128", batch=8, seq_len=1024, block_shape="8x2048",
                max_kv_mib=1024, iters=10),
    "cuda": dict(dtype="bfloat16", heads="32/8/128", batch=16, seq_len=4096, block_shape="64x4096",
                 max_kv_mib=8192, iters=50),
}
QUICK = {"cpu": dict(max_kv_mib=256, iters=3), "cuda": dict(max_kv_mib=2048, iters=10)}
CSV_COLUMNS = ["sweep", "batch", "seq_len", "block_size", "kv_bytes", "paged_s", "sdpa_s", "paged_GBps",
               "sdpa_GBps", "paged_pct_bw", "sdpa_pct_bw", "speedup", "max_err"]


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--dtype", choices=DTYPES, help="default float32 on cpu, bfloat16 on cuda")
    ap.add_argument("--heads", help="num_heads/num_kv_heads/head_dim (default 16/8/128 cpu, 32/8/128 cuda)")
    ap.add_argument("--batch", type=int, help="batch of the context sweep (default 8 cpu, 16 cuda)")
    ap.add_argument("--seq-len", type=int, help="context of the batch sweep (default 1024 cpu, 4096 cuda)")
    ap.add_argument("--block-size", type=int, default=16, help="block_size of the context and batch sweeps")
    ap.add_argument("--block-shape", help="BATCHxSEQ_LEN of the block sweep (default 8x2048 cpu, 64x4096 cuda)")
    ap.add_argument("--max-kv-mib", type=int, help="skip points whose K+V exceed this (default 1024 cpu, 8192 cuda)")
    ap.add_argument("--sweeps", default="context,batch,block", help="comma list of context, batch, block")
    ap.add_argument("--iters", type=int, help="timed runs per kernel and point, at least (default 10 cpu, 50 cuda)")
    ap.add_argument("--quick", action="store_true", help="smaller K/V cap and fewer runs (CPU: under a minute)")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "out"))
    args = ap.parse_args(argv)
    defaults = {**DEFAULTS[args.device], **(QUICK[args.device] if args.quick else {})}
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.num_heads, args.num_kv_heads, args.head_dim = (int(x) for x in args.heads.split("/"))
    args.block_batch, args.block_seq_len = (int(x) for x in args.block_shape.lower().split("x"))
    args.sweeps = [s.strip() for s in args.sweeps.split(",") if s.strip()]
    unknown = set(args.sweeps) - set(SWEEPS)
    if unknown:
        ap.error(f"--sweeps: unknown {sorted(unknown)}; expected some of {list(SWEEPS)}")
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA device visible")
    return args


def sweep_points(args) -> list[tuple[str, int, int, int]]:
    """(sweep, batch, seq_len, block_size) for every requested point, before the K/V cap."""
    points = []
    for sweep in args.sweeps:
        for x in SWEEPS[sweep]:
            if sweep == "context":
                points.append((sweep, args.batch, x, args.block_size))
            elif sweep == "batch":
                points.append((sweep, x, args.seq_len, args.block_size))
            else:
                points.append((sweep, args.block_batch, args.block_seq_len, x))
    return points


def kv_bytes(args, batch: int, seq_len: int) -> int:
    """Bytes of K and V one decode step reads (same formula as DecodeProblem.kv_bytes)."""
    itemsize = torch.empty((), dtype=DTYPES[args.dtype]).element_size()
    return 2 * batch * args.num_kv_heads * seq_len * args.head_dim * itemsize


def sdpa_baseline(args):
    """Contiguous SDPA: the flash backend on the GPU for half types (as bench/decode_gpu.py), else default."""
    if args.device == "cuda" and args.dtype != "float32":
        from decode_gpu import sdpa_flash
        return sdpa_flash
    return sdpa_decode


def timed(fns: dict, args, target_s: float) -> dict:
    """Median seconds of each function, timed in alternation: at least --iters runs, more (up to
    10x) while a point is fast."""
    t0 = time.perf_counter()
    for fn in fns.values():
        fn()
    if args.device == "cuda":
        torch.cuda.synchronize()
    estimate = max(time.perf_counter() - t0, 1e-6)
    iters = max(args.iters, min(10 * args.iters, int(target_s / estimate)))
    return interleaved_medians(fns, iters, warmup=1 if args.quick else 3, device=args.device)


def measure_point(args, point, roof: float) -> dict:
    """Paged and contiguous decode on one problem; GB/s counts the K+V bytes read once."""
    sweep, batch, seq_len, block_size = point
    p = make_decode_problem(batch, seq_len, args.num_heads, args.num_kv_heads, args.head_dim, block_size,
                            DTYPES[args.dtype], device=args.device)
    paged = lambda: minipaged_ops.paged_attention_decode(p.query, p.key_cache, p.value_cache, p.block_tables,
                                                         p.seq_lens, p.scale)
    sdpa = sdpa_baseline(args)
    max_err = (paged().float() - sdpa(p).float()).abs().max().item()
    target_s = 0.1 if args.quick else 0.5
    t = timed({"paged": paged, "sdpa": lambda: sdpa(p)}, args, target_s)
    paged_s, sdpa_s = t["paged"], t["sdpa"]
    n = p.kv_bytes
    return dict(sweep=sweep, batch=batch, seq_len=seq_len, block_size=block_size, kv_bytes=n,
                paged_s=paged_s, sdpa_s=sdpa_s, paged_GBps=n / paged_s / 1e9, sdpa_GBps=n / sdpa_s / 1e9,
                paged_pct_bw=100 * n / paged_s / roof, sdpa_pct_bw=100 * n / sdpa_s / roof,
                speedup=sdpa_s / paged_s, max_err=max_err)


def run_sweeps(args, roof: float) -> tuple[list[dict], list[tuple]]:
    """Measure every point under the cap, one tqdm bar per sweep; return rows and skipped points."""
    cap = args.max_kv_mib * 2**20
    rows, skipped = [], []
    points = sweep_points(args)
    for sweep in args.sweeps:
        mine = [pt for pt in points if pt[0] == sweep]
        keep = [pt for pt in mine if kv_bytes(args, pt[1], pt[2]) <= cap]
        skipped += [pt for pt in mine if pt not in keep]
        bar = tqdm(keep, desc=f"{sweep:>7}", unit="pt", leave=True)
        for pt in bar:
            bar.set_postfix_str(f"batch {pt[1]} x {pt[2]}, block {pt[3]}")
            rows.append(measure_point(args, pt, roof))
            if args.device == "cuda":
                torch.cuda.empty_cache()
    return rows, skipped


def write_csv(rows: list[dict], path: str) -> None:
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CSV_COLUMNS)
        w.writeheader()
        for r in rows:
            w.writerow({k: (f"{v:.6g}" if isinstance(v, float) else v) for k, v in r.items()})


def print_rows(rows: list[dict]) -> None:
    table = [dict(sweep=r["sweep"], batch=r["batch"], seq_len=r["seq_len"], block=r["block_size"],
                  MiB=f"{r['kv_bytes'] / 2**20:.0f}", paged_ms=f"{r['paged_s'] * 1e3:.3f}",
                  sdpa_ms=f"{r['sdpa_s'] * 1e3:.3f}", paged_GBps=f"{r['paged_GBps']:.1f}",
                  sdpa_GBps=f"{r['sdpa_GBps']:.1f}", paged_bw=f"{r['paged_pct_bw']:.0f}%",
                  sdpa_bw=f"{r['sdpa_pct_bw']:.0f}%", speedup=f"{r['speedup']:.2f}x",
                  max_err=f"{r['max_err']:.1e}") for r in rows]
    print_table(table, list(table[0]))


def plot_lines(ax, rows, x_key, y_key, roof_y=None, roof_label=None):
    """Paged vs contiguous on a log2 x axis; an optional dashed horizontal roof."""
    xs = [r[x_key] for r in rows]
    ax.plot(xs, [r[f"paged_{y_key}"] for r in rows], "o-", label="minipaged (paged, shuffled blocks)")
    ax.plot(xs, [r[f"sdpa_{y_key}"] for r in rows], "s-", label="SDPA (contiguous K/V)")
    if roof_y is not None:
        ax.axhline(roof_y, color="k", ls="--", lw=1, label=roof_label)
    ax.set_xscale("log", base=2)
    ax.set_xticks(xs)
    ax.set_xticklabels([f"{x // 1024}K" if x >= 1024 else str(x) for x in xs], fontsize=8)
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)


def plot_block(ax, rows, roof_gbps, roof_label):
    xs = range(len(rows))
    ax.bar([x - 0.2 for x in xs], [r["paged_GBps"] for r in rows], 0.4, label="minipaged (paged)")
    ax.bar([x + 0.2 for x in xs], [r["sdpa_GBps"] for r in rows], 0.4, label="SDPA (contiguous)")
    ax.axhline(roof_gbps, color="k", ls="--", lw=1, label=roof_label)
    ax.set_xticks(list(xs), [str(r["block_size"]) for r in rows])
    r0 = rows[0]
    ax.set(xlabel="block_size (tokens)", ylabel="achieved GB/s",
           title=f"block size, batch {r0['batch']} x {r0['seq_len']} tokens")
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=8)


def plot(rows: list[dict], skipped: list[tuple], args, roof: float, roof_name: str, path: str) -> None:
    """One panel per view: context GB/s, context % of roof, batch GB/s, block-size bars."""
    by = {s: [r for r in rows if r["sweep"] == s] for s in SWEEPS}
    roof_gbps = roof / 1e9
    roof_label = f"{roof_name}: {roof_gbps:.0f} GB/s"
    panels = []
    if by["context"]:
        panels += ["context_gbps", "context_pct"]
    if by["batch"]:
        panels.append("batch_gbps")
    if by["block"]:
        panels.append("block")
    ncols = min(len(panels), 2)
    nrows = math.ceil(len(panels) / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(6.5 * ncols, 4.6 * nrows), squeeze=False)
    for ax, panel in zip(axes.flat, panels):
        if panel == "context_gbps":
            plot_lines(ax, by["context"], "seq_len", "GBps", roof_gbps, roof_label)
            ax.set(xlabel="context length (tokens per sequence)", ylabel="achieved GB/s (K+V bytes / time)",
                   title=f"bandwidth vs context, batch {args.batch}")
        elif panel == "context_pct":
            plot_lines(ax, by["context"], "seq_len", "pct_bw", 100.0, f"100% of {roof_name}")
            ax.set(xlabel="context length (tokens per sequence)", ylabel=f"% of {roof_name}",
                   title=f"fraction of bandwidth vs context, batch {args.batch}")
        elif panel == "batch_gbps":
            plot_lines(ax, by["batch"], "batch", "GBps", roof_gbps, roof_label)
            ax.set(xlabel="batch (sequences)", ylabel="achieved GB/s (K+V bytes / time)",
                   title=f"bandwidth vs batch, {args.seq_len} tokens each")
        else:
            plot_block(ax, by["block"], roof_gbps, roof_label)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    fig.suptitle(f"decode attention, {machine_name(args.device)}\n{args.dtype}, heads "
                 f"{args.num_heads}/{args.num_kv_heads}/{args.head_dim} (q/kv/dim), block {args.block_size} (context, batch), "
                 f"torch {torch.__version__}", fontsize=10)
    note = "Every timed run starts with caches full of other data (as in a model step)."
    if skipped:
        note += f"  Skipped (K+V > {args.max_kv_mib} MiB): " + ", ".join(f"{s} {b}x{n}" for s, b, n, _ in skipped)
    fig.text(0.01, 0.005, note, fontsize=7, color="gray")
    fig.tight_layout(rect=(0, 0.02, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> None:
    args = parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    if args.device == "cuda":
        roof, roof_name = copy_bandwidth("cuda", nbytes=2 << 30), "D2D copy bw (read+write)"
    else:
        roof, roof_name = read_bandwidth(), "read bw (large sum)"
    print(f"{machine_name(args.device)}; torch {torch.__version__}; minipaged {minipaged_ops.build_info()}")
    print(f"{args.dtype}, heads {args.num_heads}/{args.num_kv_heads}/{args.head_dim}; {roof_name}: "
          f"{roof / 1e9:.1f} GB/s; K+V cap {args.max_kv_mib} MiB; >= {args.iters} runs per kernel and point")
    rows, skipped = run_sweeps(args, roof)
    if skipped:
        print(f"skipped (K+V over the {args.max_kv_mib} MiB cap, raise --max-kv-mib): " + ", ".join(
            f"{s} sweep {b} x {n} ({kv_bytes(args, b, n) / 2**20:.0f} MiB)" for s, b, n, _ in skipped))
    if not rows:
        return
    print_rows(rows)
    stem = os.path.join(args.out, f"sweep_{args.device}_{args.dtype}")
    write_csv(rows, stem + ".csv")
    plot(rows, skipped, args, roof, roof_name, stem + ".png")
    print(f"wrote {stem}.csv and {stem}.png")


if __name__ == "__main__":
    main()
