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
import time

import torch

TEXT_PROMPTS = [
    "The paged KV cache stores keys and values in fixed-size blocks, so that",
    "Hello!",
    "Write a short poem about the sea, the wind and a small boat that keeps sailing through the night "
    "until the morning light shows the harbour:",
    "In one sentence, what is attention in a transformer?",
    "List three prime numbers:",
]


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


# the demo's tiny random Qwen3 (minipaged_ops.tiny.tiny_model arguments)
DEMO_MODEL = dict(vocab=512, hidden=256, intermediate=512, layers=4, heads=4, kv_heads=2, head_dim=64,
                  max_positions=2048, init_range=0.3)


def load(args, device, dtype):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from minipaged_ops.tiny import tiny_model

    if args.model is None:
        return tiny_model("qwen3", seed=args.seed, dtype=dtype, device=device, **DEMO_MODEL), None
    tok = AutoTokenizer.from_pretrained(args.model, local_files_only=True, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(args.model, local_files_only=True, dtype=dtype).to(device).eval()
    if getattr(model.config, "model_type", "") != "qwen3":
        print(f"note: model_type is {model.config.model_type!r}; the demo targets Qwen3", file=sys.stderr)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    model.generation_config.pad_token_id = tok.pad_token_id
    return model, tok


def make_batch(args, model, tok, device):
    if tok is not None:
        prompts = [TEXT_PROMPTS[i % len(TEXT_PROMPTS)] for i in range(args.batch)]
        enc = tok(prompts, return_tensors="pt", padding=True)
        return enc["input_ids"].to(device), enc["attention_mask"].to(device)
    g = torch.Generator().manual_seed(args.seed)
    lengths = [[37, 12, 64, 5, 50, 23, 8, 41][i % 8] for i in range(args.batch)]
    width = max(lengths)
    ids = torch.zeros(args.batch, width, dtype=torch.long)
    mask = torch.zeros(args.batch, width, dtype=torch.long)
    for i, n in enumerate(lengths):
        ids[i, width - n:] = torch.randint(3, model.config.vocab_size, (n,), generator=g)
        mask[i, width - n:] = 1
    return ids.to(device), mask.to(device)


class StepRecorder:
    """Forward hook: a progress bar over decode steps and the blocks in use after each step."""

    def __init__(self, model, total, desc, cache=None):
        from tqdm.auto import tqdm

        self.cache = cache
        self.blocks = []
        self.bar = tqdm(total=total, desc=desc, unit="step", leave=False, delay=0.5, file=sys.stderr,
                        disable=None)  # None: only on a terminal
        self.handle = model.register_forward_hook(self._step)

    def _step(self, module, args, output):
        self.bar.update(1)
        if self.cache is not None:
            self.blocks.append(self.cache.num_blocks - self.cache.block_manager.num_free_blocks)

    def close(self):
        self.handle.remove()
        self.bar.close()


def timed_generate(model, impl, ids, mask, cache, desc, **kwargs):
    """``(sequences, logits [batch, steps, vocab], seconds, blocks in use per step)``."""
    from minipaged_ops.integration import _compat

    model.set_attn_implementation(impl)
    rec = StepRecorder(model, kwargs["max_new_tokens"], desc, cache)
    extra = {} if cache is None else _compat.cache_kwargs(cache)
    kwargs = dict(kwargs, return_dict_in_generate=True, output_logits=True)
    try:
        if ids.is_cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        with torch.no_grad():
            out = model.generate(ids, attention_mask=mask, **extra, **kwargs)
        if ids.is_cuda:
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
    finally:
        rec.close()
    return out.sequences, torch.stack(out.logits, 1), seconds, rec.blocks


def same_tokens(ref, ref_logits, out, out_logits, prompt_width, dtype, top_k) -> tuple[bool, str]:
    """Exact equality in float32; in bfloat16/float16, equal up to near-ties (compare_greedy)."""
    from minipaged_ops.tiny import compare_greedy

    if torch.equal(out, ref):
        return True, "yes"
    rows = (out != ref).any(1).nonzero().flatten().tolist()
    if dtype == torch.float32:
        return False, f"NO, rows {rows}"
    matches = compare_greedy(ref[:, prompt_width:], ref_logits, out[:, prompt_width:], out_logits, top_k)
    ok = all(m.close for m in matches)
    where = ", ".join(f"row {r} at token {matches[r].first_difference}" for r in rows)
    verdict = "yes, up to near-ties" if ok else "NO"
    return ok, (f"{verdict} ({str(dtype).removeprefix('torch.')}: first differences {where}; each side's token "
                f"{'is' if ok else 'is not always'} in the other's top-{top_k} there)")


def format_report(stats: dict) -> str:
    """``engine.stats()`` as aligned lines; latency percentiles in ms, bytes in MiB."""
    lines = []
    for key, value in stats.items():
        if isinstance(value, dict):
            ms = key.endswith("_s")
            text = "  ".join(f"{k} {v * 1e3:,.1f}" if ms else f"{k} {v}" for k, v in value.items())
            key, text = (key[:-2] + "_ms", text) if ms else (key, text)
        elif key.endswith("bytes") or "_bytes_" in key:
            text = fmt_bytes(value)
        elif isinstance(value, float):
            text = f"{value:.3f}"
        else:
            text = str(value)
        lines.append(f"  {key:26} {text}")
    return "\n".join(lines)


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.1f} {unit}"
        n /= 1024


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
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
        ax.plot(range(1, len(steps) + 1), steps, label="minipaged (allocated on demand)")
        ax.axhline(contiguous_tokens / bs, color="gray", ls="--", label="contiguous, reserved for max length")
        ax.set_title(f"greedy, ragged batch of {len(lengths)}")
        ax2.plot(range(1, len(steps_n) + 1), steps_n, color="tab:orange", label="minipaged (prompt blocks shared)")
        ax2.axhline(unshared, color="gray", ls=":", label="without sharing (at the end)")
        ax2.set_title(f"sampling, num_return_sequences={args.n}")
        for a in (ax, ax2):
            a.set_xlabel("forward step (1 = prefill)")
            a.legend(fontsize=8, loc="lower right")
        ax.set_ylabel(f"KV blocks in use ({bs} tokens each)")
        fig.tight_layout()
        fig.savefig(args.plot, dpi=120)
        print(f"\nwrote {args.plot}")
    engine_ok = run_engine(model, args, device, dtype) if args.requests else True
    return 0 if equal and engine_ok else 1


def run_engine(model, args, device, dtype) -> bool:
    """Requests arriving over time through LLMEngine on a pool of about half their peak demand."""
    from tqdm.auto import tqdm

    from minipaged_ops.integration import LLMEngine, SamplingParams

    g = torch.Generator().manual_seed(args.seed + 1)
    vocab = model.config.vocab_size
    prompts = [torch.randint(3, vocab, (int(torch.randint(8, 96, (1,), generator=g)),), generator=g).tolist()
               for _ in range(args.requests)]
    max_tokens = [int(torch.randint(8, args.max_new_tokens + 1, (1,), generator=g)) for _ in prompts]
    arrivals, t = [], 0.0
    for _ in prompts:
        arrivals.append(t)
        t += float(torch.empty(1).exponential_(args.rate, generator=g))
    bs = args.block_size
    peak = sum(math.ceil((len(p) + m) / bs) for p, m in zip(prompts, max_tokens))
    num_blocks = max(peak // 2, max(math.ceil((len(p) + m) / bs) for p, m in zip(prompts, max_tokens)) + 1)
    engine = LLMEngine(model, num_blocks=num_blocks, block_size=bs, max_num_seqs=16, max_num_batched_tokens=256)
    print(f"\nserving engine: {len(prompts)} requests arriving at {args.rate:g}/s (prompts 8-95 tokens, up to "
          f"{args.max_new_tokens} new, greedy) into {num_blocks} blocks of {bs}: about half of their peak demand "
          f"({peak} blocks)")
    bar = tqdm(total=len(prompts), desc="engine", unit="req", file=sys.stderr, disable=None)
    outputs, i, start = {}, 0, time.perf_counter()
    while i < len(prompts) or engine.has_unfinished_requests():
        while i < len(prompts) and start + arrivals[i] <= time.perf_counter():
            engine.add_request(f"req-{i}", prompts[i], SamplingParams(max_tokens=max_tokens[i], ignore_eos=True))
            i += 1
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, start + arrivals[i] - time.perf_counter()))
            continue
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out.outputs[0].token_ids
                bar.update(1)
        s = engine.stats()
        bm = engine.block_manager
        bar.set_postfix_str(f"running {s.get('running')}, waiting {s.get('waiting')}, "
                            f"blocks {bm.num_blocks - bm.num_free_blocks}/{bm.num_blocks}, "
                            f"preemptions {s.get('preemptions')}", refresh=False)
    seconds = time.perf_counter() - start
    bar.close()
    generated = sum(len(v) for v in outputs.values())
    print(f"done in {seconds:.1f} s: {generated} tokens, {generated / seconds:.1f} tokens/s")
    print("capacity report (engine.stats()):")
    print(format_report(engine.stats()))

    # every request against generate() on its prompt alone (sdpa, DynamicCache)
    model.set_attn_implementation("sdpa")
    same = 0
    with torch.no_grad():
        for k, (prompt, n) in enumerate(zip(prompts, max_tokens)):
            ref = model.generate(torch.tensor([prompt], device=device), max_new_tokens=n, do_sample=False)
            same += ref[0, len(prompt):].tolist() == list(outputs[f"req-{k}"])
    if dtype == torch.float32:
        print(f"engine outputs equal generate() on each prompt alone: {'yes' if same == len(prompts) else 'NO'} "
              f"({same}/{len(prompts)} requests)")
        return same == len(prompts)
    print(f"engine outputs equal generate() on each prompt alone: {same}/{len(prompts)} requests "
          f"(in {str(dtype).removeprefix('torch.')} near-ties may flip; exact equality is checked in float32)")
    return True


if __name__ == "__main__":
    sys.exit(main())
