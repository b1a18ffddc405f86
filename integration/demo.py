"""The main demo: Qwen3 ``generate()`` on a paged KV cache, side by side with transformers' sdpa.

    python -m minipaged_ops.integration.demo                 # tiny random Qwen3, built offline
    python -m minipaged_ops.integration.demo --model PATH    # a local Qwen3 checkpoint (safetensors + tokenizer)
    python -m minipaged_ops.integration.demo --plot usage.png

It generates for a ragged (left-padded) batch with ``attn_implementation="minipaged"`` on a
``PagedKVCache`` and with ``"sdpa"`` on transformers' ``DynamicCache``, then prints whether the
tokens are equal (in bfloat16/float16: equal up to near-ties, see
``minipaged_ops.tiny.compare_greedy``), tokens/s of both, the KV memory the paged cache holds against a contiguous cache
reserved for the maximum length, and what block sharing saves in an n=4 sampling run.

Then the serving engine (``LLMEngine``): requests arrive over time into a pool smaller than
their peak demand, a live line shows what runs, waits and is held, and at the end the capacity
report (``engine.stats()``) and whether every request got the tokens ``generate()`` gives it
alone.
"""

from __future__ import annotations

import argparse
import math
import sys

import torch

from .demo_engine import run_engine
from .demo_report import fmt_bytes, format_report, plot_block_usage
from .demo_runs import DEMO_MODEL, TEXT_PROMPTS, StepRecorder, load, make_batch, same_tokens, timed_generate

# The parts live in demo_runs (inputs, timed runs), demo_report (figures, plot) and demo_engine (the
# serving part); they stay importable from here, as before the split (bench/serve.py takes format_report).
__all__ = ["DEMO_MODEL", "TEXT_PROMPTS", "StepRecorder", "fmt_bytes", "format_report", "load", "main", "make_batch",
           "parse_args", "plot_block_usage", "run_engine", "same_tokens", "timed_generate"]


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        prog="python -m minipaged_ops.integration.demo",
        description="Qwen3 generate() on a paged KV cache (minipaged) against transformers' sdpa.",
    )
    p.add_argument("--model", metavar="PATH", help="local Qwen3 checkpoint directory (loaded with local_files_only=True); "
                   "default: a tiny random Qwen3 built offline")
    p.add_argument("--batch", type=int, default=4, help="ragged batch size (default 4)")
    p.add_argument("--max-new-tokens", type=int, default=48, help="tokens to generate per sequence (default 48)")
    p.add_argument("--block-size", type=int, default=16, choices=(8, 16, 32), help="tokens per block (default 16)")
    p.add_argument("--num-blocks", type=int, default=None, help="blocks in the pool (default: enough for the runs)")
    p.add_argument("--n", type=int, default=4, help="num_return_sequences of the sampling run (default 4)")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    p.add_argument("--dtype", default=None, choices=("float32", "float16", "bfloat16"),
                   help="model dtype (default float32 on cpu, bfloat16 on cuda)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--plot", metavar="FILE", help="write a PNG of KV blocks in use per step")
    p.add_argument("--requests", type=int, default=16, help="requests sent to the engine (default 16; 0 skips it)")
    p.add_argument("--rate", type=float, default=20.0, help="engine requests arriving per second (Poisson; default 20)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    import minipaged_ops.integration  # noqa: F401  (registers "minipaged")
    from minipaged_ops.integration import PagedKVCache

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    model, tok = load(args, device, dtype)
    cfg = model.config
    ids, mask = make_batch(args, model, tok, device)
    lengths = mask.sum(1).tolist()
    new = args.max_new_tokens
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    what = args.model or "tiny random Qwen3 (built offline)"
    print(f"model: {what}: {cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, {cfg.num_attention_heads} heads / "
          f"{cfg.num_key_value_heads} KV heads, head_dim {head_dim}; {str(dtype).removeprefix('torch.')} on {device}")
    print(f"ragged batch: {len(lengths)} prompts of {'/'.join(map(str, lengths))} tokens, left-padded to "
          f"{ids.shape[1]}; {new} new tokens each, greedy")

    bs = args.block_size
    need = sum(math.ceil((n + new) / bs) for n in lengths)
    need_n = args.n * math.ceil((max(lengths) + new) / bs)
    num_blocks = args.num_blocks or max(need, need_n) + 8
    gen = dict(max_new_tokens=new, do_sample=False)
    if tok is None:
        gen["pad_token_id"] = 0

    # warm-up (first-call allocations, lazy init) on a short run of each
    warm = dict(gen, max_new_tokens=2)
    timed_generate(model, "sdpa", ids, mask, None, "warm-up", **warm)
    timed_generate(model, "minipaged", ids, mask, PagedKVCache(model, num_blocks, bs), "warm-up", **warm)

    # best of two, alternating, to damp the noise of a shared machine
    t_sdpa = t_paged = float("inf")
    for _ in range(2):
        ref, ref_logits, t, _ = timed_generate(model, "sdpa", ids, mask, None, "sdpa", **gen)
        t_sdpa = min(t_sdpa, t)
        cache = PagedKVCache(model, num_blocks, bs)
        out, out_logits, t, steps = timed_generate(model, "minipaged", ids, mask, cache, "minipaged", **gen)
        t_paged = min(t_paged, t)
    equal, verdict = same_tokens(ref, ref_logits, out, out_logits, ids.shape[1], dtype, top_k=5)
    generated = len(lengths) * new
    print()
    print(f"{'':28}{'sdpa + DynamicCache':>22}{'minipaged + PagedKVCache':>28}")
    print(f"{'tokens/s (whole generate)':28}{generated / t_sdpa:>22,.1f}{generated / t_paged:>28,.1f}"
          f"   ({t_sdpa / t_paged:.2f}x)")
    print(f"tokens equal: {verdict} ({len(lengths)} x {new} tokens)")
    if tok is not None:
        for row in out[:2]:
            print("  >", repr(tok.decode(row[ids.shape[1]:], skip_special_tokens=True))[:100])

    u = cache.usage()
    per_block = cache.bytes_per_block
    contiguous_tokens = len(lengths) * (ids.shape[1] + new)
    contiguous = contiguous_tokens * per_block // bs
    print()
    print(f"KV memory held after generate: {u['blocks_used']} blocks of {bs} tokens = {fmt_bytes(u['kv_bytes_used'])} "
          f"({u['tokens_stored']} tokens stored, {u['slots_wasted']} slots of last blocks unused, pads never stored)")
    print(f"contiguous cache reserved for the max length ({len(lengths)} x {ids.shape[1] + new} tokens): "
          f"{fmt_bytes(contiguous)}  ->  paged holds {u['kv_bytes_used'] / contiguous:.0%} of it")

    # n-way sampling from one prompt: the prompt's blocks are stored once
    longest = max(range(len(lengths)), key=lambda i: lengths[i])
    one_ids, one_mask = ids[longest:longest + 1], mask[longest:longest + 1]
    cache_n = PagedKVCache(model, num_blocks, bs)
    torch.manual_seed(args.seed)
    sample = dict(gen, do_sample=True, top_k=50, temperature=1.0, num_return_sequences=args.n)
    out_n, logits_n, _, steps_n = timed_generate(model, "minipaged", one_ids, one_mask, cache_n,
                                                 f"sampling n={args.n}", **sample)
    torch.manual_seed(args.seed)
    ref_n, ref_logits_n, _, _ = timed_generate(model, "sdpa", one_ids, one_mask, None, f"sdpa n={args.n}", **sample)
    # the same random draws pick neighbouring tokens when rounding moves a boundary: both sides'
    # tokens are then among the other's top_k=50 candidates
    _, verdict_n = same_tokens(ref_n, ref_logits_n, out_n, logits_n, one_ids.shape[1], dtype, top_k=50)
    un = cache_n.usage()
    bm = cache_n.block_manager
    unshared = sum(math.ceil(bm.sequence_length(s) / bs) for s in cache_n.sequence_ids)
    saved = unshared - un["blocks_used"]
    distinct = len({tuple(r) for r in out_n.tolist()})
    print()
    print(f"sampling, num_return_sequences={args.n} from one {lengths[longest]}-token prompt ({distinct} distinct "
          f"continuations, same tokens as sdpa: {verdict_n}):")
    print(f"  {un['blocks_used']} blocks held ({un['blocks_shared']} shared) vs {unshared} without sharing: "
          f"saves {saved} blocks ({saved / unshared:.0%}), {fmt_bytes(saved * per_block)}")

    if args.plot:
        plot_block_usage(args.plot, steps, steps_n, contiguous_tokens / bs, unshared, len(lengths), args.n, bs)
        print(f"\nwrote {args.plot}")
    engine_ok = run_engine(model, args, device, dtype) if args.requests else True
    return 0 if equal and engine_ok else 1


if __name__ == "__main__":
    sys.exit(main())
