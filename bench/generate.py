"""tokens/s of ``model.generate`` on minipaged's PagedKVCache against transformers' sdpa with its
DynamicCache and its StaticCache, eager and compiled, side by side in one run.

Default: a random Qwen3 shaped like Qwen3-0.6B (hidden 1024, 16 heads / 8 KV heads, head_dim 128,
vocab 151936) with fewer layers, batch 8, prompt 512, 128 new tokens, greedy.

    python bench/generate.py                 # the full table (several minutes on a CPU)
    python bench/generate.py --quick         # tiny shapes, a smoke run
    python bench/generate.py --layers 2 --prompt 256 --no-compile
"""

from __future__ import annotations

import argparse
import math
import sys
import time

import torch


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--prompt", type=int, default=512, help="prompt tokens per sequence")
    p.add_argument("--new", type=int, default=128, help="new tokens per sequence")
    p.add_argument("--layers", type=int, default=4, help="decoder layers (Qwen3-0.6B has 28)")
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--intermediate", type=int, default=3072)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--block-size", type=int, default=16, choices=(8, 16, 32))
    p.add_argument("--ragged", action="store_true", help="left-pad the batch to random lengths in [prompt/2, prompt]")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    p.add_argument("--dtype", default=None, choices=("float32", "float16", "bfloat16"),
                   help="default float32 on cpu, bfloat16 on cuda")
    p.add_argument("--no-compile", action="store_true", help="eager rows only")
    p.add_argument("--backend", default="inductor", help="torch.compile backend (default inductor)")
    p.add_argument("--repeats", type=int, default=2, help="timed runs per row; the best is reported")
    p.add_argument("--only", default=None, help="comma-separated subset of rows: dynamic,static,paged")
    p.add_argument("--quick", action="store_true", help="tiny shapes: batch 2, prompt 64, 16 new, 2 layers, hidden 256")
    args = p.parse_args(argv)
    if args.quick:
        args.batch, args.prompt, args.new, args.layers = 2, 64, 16, 2
        args.hidden, args.intermediate, args.heads, args.kv_heads, args.head_dim, args.vocab = 256, 512, 4, 2, 64, 4096
        args.repeats = 2
    return args


def build_model(args, device, dtype):
    from minipaged_ops.tiny import tiny_model

    return tiny_model(
        "qwen3", vocab=args.vocab, hidden=args.hidden, intermediate=args.intermediate, layers=args.layers,
        heads=args.heads, kv_heads=args.kv_heads, head_dim=args.head_dim,
        max_positions=max(4096, args.prompt + args.new), init_range=None, tie_embeddings=True,
        dtype=dtype, device=device,
    )


def make_inputs(args, device):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, args.vocab, (args.batch, args.prompt), generator=g)
    mask = torch.ones_like(ids)
    if args.ragged:
        lengths = torch.randint(args.prompt // 2, args.prompt + 1, (args.batch,), generator=g)
        for i, n in enumerate(lengths.tolist()):
            mask[i, : args.prompt - n] = 0
            ids[i, : args.prompt - n] = 0
    return ids.to(device), mask.to(device)


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def run_row(model, kind, compiled, args, ids, mask, device):
    """Best wall time of ``generate`` for one row, its output, and the paged cache (if any)."""
    from minipaged_ops.integration import PagedKVCache, _compat

    gen = dict(attention_mask=mask, max_new_tokens=args.new, do_sample=False, pad_token_id=0)
    cache = None
    if kind == "paged":
        model.set_attn_implementation("minipaged")
        bs = args.block_size
        num_blocks = args.batch * math.ceil((args.prompt + args.new) / bs) + 8
    else:
        model.set_attn_implementation("sdpa")
        if kind == "static":
            gen["cache_implementation"] = "static"

    original = model.forward
    if compiled:
        # the dynamic cache grows every step: compile it with dynamic shapes (else it recompiles
        # per step until it hits the recompile limit); the static and paged caches need none
        model.forward = torch.compile(original, backend=args.backend, fullgraph=kind != "dynamic",
                                      dynamic=True if kind == "dynamic" else None)
    try:
        best, out = float("inf"), None
        for i in range(args.repeats + (1 if compiled else 0)):  # compiled: first run compiles
            kwargs = dict(gen)
            if kind == "paged":
                cache = PagedKVCache(model, num_blocks, args.block_size)
                kwargs.update(_compat.cache_kwargs(cache))
            sync(device)
            start = time.perf_counter()
            with torch.no_grad():
                out = model.generate(ids, **kwargs)
            sync(device)
            seconds = time.perf_counter() - start
            if compiled and i == 0:
                print(f"    ({kind} compiled: first generate incl. compilation {seconds:.1f} s)", file=sys.stderr)
                continue
            best = min(best, seconds)
        # the prefill alone (one new token), to split the time into prefill and decode
        kwargs = dict(gen, max_new_tokens=1)
        if kind == "paged":
            kwargs.update(_compat.cache_kwargs(PagedKVCache(model, num_blocks, args.block_size)))
        sync(device)
        start = time.perf_counter()
        with torch.no_grad():
            model.generate(ids, **kwargs)
        sync(device)
        prefill = time.perf_counter() - start
    finally:
        if compiled:
            model.forward = original
            torch._dynamo.reset()
    return best, prefill, out, cache


def main(argv=None) -> int:
    args = parse_args(argv)
    import minipaged_ops.integration  # noqa: F401

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    model = build_model(args, device, dtype)
    ids, mask = make_inputs(args, device)
    params = sum(p.numel() for p in model.parameters()) / 1e6
    print(f"Qwen3-0.6B-shaped random model: {args.layers} layers, hidden {args.hidden}, {args.heads}/{args.kv_heads} "
          f"heads, head_dim {args.head_dim}, vocab {args.vocab} ({params:.0f}M params), {str(dtype)[6:]} on {device}")
    print(f"batch {args.batch}, prompt {args.prompt}{' (ragged)' if args.ragged else ''}, {args.new} new tokens, "
          f"greedy; best of {args.repeats}; torch {torch.__version__}, {torch.get_num_threads()} threads")

    rows = [k for k in ("dynamic", "static", "paged") if args.only is None or k in args.only.split(",")]
    labels = {"dynamic": "sdpa + DynamicCache", "static": "sdpa + StaticCache", "paged": "minipaged + PagedKVCache"}
    modes = [False] if args.no_compile else [False, True]
    results, outputs = {}, {}
    for compiled in modes:
        for kind in rows:
            print(f"  running {labels[kind]} {'compiled' if compiled else 'eager'} ...", file=sys.stderr)
            seconds, prefill, out, cache = run_row(model, kind, compiled, args, ids, mask, device)
            results[kind, compiled] = seconds
            results["prefill", kind, compiled] = prefill
            outputs[kind, compiled] = out
            if cache is not None:
                u = cache.usage()
                results["paged_blocks"] = (u["blocks_used"], u["kv_bytes_used"])

    tokens = args.batch * args.new
    base = results.get(("dynamic", False))
    print()
    print(f"{'':28}{'mode':>10}{'seconds':>10}{'tokens/s':>11}{'vs dynamic eager':>18}"
          f"{'prefill s':>11}{'decode tok/s':>14}{'same tokens':>13}")
    ref = outputs.get(("dynamic", False), next(iter(outputs.values())))
    decode_tokens = args.batch * (args.new - 1)
    for compiled in modes:
        for kind in rows:
            s = results[kind, compiled]
            prefill = results["prefill", kind, compiled]
            ratio = f"{base / s:.2f}x" if base else "-"
            decode = f"{decode_tokens / (s - prefill):.1f}" if s > prefill else "-"
            same = "yes" if torch.equal(outputs[kind, compiled], ref) else "NO"
            print(f"{labels[kind]:28}{'compiled' if compiled else 'eager':>10}{s:>10.2f}{tokens / s:>11.1f}{ratio:>18}"
                  f"{prefill:>11.2f}{decode:>14}{same:>13}")
    for compiled in modes:
        if ("paged", compiled) in results and ("static", compiled) in results:
            mode = "compiled" if compiled else "eager"
            print(f"minipaged / static ({mode}): {results['static', compiled] / results['paged', compiled]:.2f}x;  "
                  f"minipaged / dynamic ({mode}): {results['dynamic', compiled] / results['paged', compiled]:.2f}x"
                  if ("dynamic", compiled) in results else "")
    if "paged_blocks" in results:
        blocks, nbytes = results["paged_blocks"]
        elem = torch.empty((), dtype=dtype).element_size()
        static = 2 * args.layers * args.kv_heads * args.head_dim * elem * args.batch * (args.prompt + args.new)
        print(f"KV memory: paged holds {blocks} blocks = {nbytes / 2**20:.1f} MiB; a static cache for this batch "
              f"reserves {static / 2**20:.1f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
