"""serve.py --structured: the tokenizer its engine rows share, and the comparison it prints.

The model is random, so its tokenizer is the tiny byte-level BPE padded with placeholder tokens up
to the model's vocabulary (151936 for the Qwen3-0.6B shape): the grammar engine reads a
vocabulary of the real size. Throughput counts the tokens each run really produced (a completed
schema ends a request before max_tokens), paired round by round with the unconstrained engine run
next to it.
"""

from __future__ import annotations

import statistics
import time


def bench_tokenizer(vocab: int):
    from minipaged_ops.tiny import tiny_tokenizer

    tokenizer = tiny_tokenizer()
    tokenizer.add_tokens([f"<|extra_{i}|>" for i in range(vocab - len(tokenizer))])
    return tokenizer


def output_tokens(run, every: int = 0, constrained: bool = True) -> int:
    """Tokens the run produced; ``every=k``: only the requests i with (i % k == 0) == constrained."""
    return sum(len(t) for i, tl in enumerate(_ordered(run)) if not every or (i % every == 0) == constrained
               for t in tl.tokens)


def _ordered(run):
    return [run.timelines[k] for k in sorted(run.timelines, key=lambda k: int(k[1:]))]  # ids "r{i}"


def tpot(run, every: int, constrained: bool) -> float:
    """Median seconds per output token after the first, over the requests picked as in output_tokens."""
    values = [(tl.finish - tl.first_token) / (len(tl.tokens[0]) - 1) for i, tl in enumerate(_ordered(run))
              if (i % every == 0) == constrained and len(tl.tokens[0]) > 1]
    return statistics.median(values)


def print_structured(runs: dict, tokenizer, vocab: int, schema: dict) -> None:
    base = runs["engine"]
    full, half = runs.get("engine, json schema", []), runs.get("engine, half json schema", [])
    print("\nstructured outputs (actual output tokens; ratios paired round by round with the unconstrained engine):")
    if full:
        ratios = [(output_tokens(f) / f.wall) / (output_tokens(b) / b.wall) for f, b in zip(full, base)]
        print(f"  every request with the JSON schema: out tok/s {_span(ratios)} of unconstrained "
              f"({output_tokens(full[0])} tokens vs {output_tokens(base[0])})")
    if half:
        slow = [tpot(h, 2, False) / tpot(b, 2, False) for h, b in zip(half, base)]
        print(f"  half the requests with it: the unconstrained half's TPOT p50 {_span(slow)} of the same requests' "
              f"in the unconstrained run (> 1: slower)")
    compiled = [s for r in full + half for s in r.stats.get("compile_seconds", [])]
    if compiled:
        print(f"  grammar compile (the schema, once per engine): {', '.join(f'{s * 1e3:.0f}' for s in compiled)} ms")
    print(f"  {_compile_times(tokenizer, vocab, schema)}")
    print(f"  {_mask_times(vocab)}")


def _mask_times(vocab: int, rows: int = 16, repeats: int = 7) -> str:
    """What applying a step's masks to ``rows`` rows of logits costs: minipaged's op against
    xgrammar's CPU apply, alternated, best of ``repeats``, for nearly-closed rows (1 token in
    1000 allowed: inside JSON structure), half-open and nearly-open ones (inside a free string)."""
    import torch
    import xgrammar

    import minipaged_ops

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(rows, vocab, generator=g)
    indices = list(range(rows))
    parts = []
    for name, density in (("nearly closed", 0.001), ("half", 0.5), ("nearly open", 0.999)):
        bits = (torch.rand(rows, -(-vocab // 32) * 32, generator=g) < density).view(rows, -1, 32).long()
        words = (bits << torch.arange(32)).sum(-1)
        bitmask = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
        best = {"minipaged": float("inf"), "xgrammar": float("inf")}
        for _ in range(repeats):
            for way in best:
                x = logits.clone()
                started = time.perf_counter()
                if way == "minipaged":
                    minipaged_ops.apply_token_bitmask_(x, bitmask, torch.tensor(indices))
                else:
                    xgrammar.apply_token_bitmask_inplace(x, bitmask, vocab_size=vocab, indices=indices)
                best[way] = min(best[way], time.perf_counter() - started)
        parts.append(f"{name} {best['minipaged'] * 1e3:.2f} vs {best['xgrammar'] * 1e3:.2f} ms")
    return f"applying the masks of {rows} rows (minipaged's op vs xgrammar's, best of {repeats}): " + ", ".join(parts)


def _span(values) -> str:
    values = sorted(values)
    med = statistics.median(values)
    return f"{med:.1%}" if len(values) == 1 else f"{med:.1%} (rounds {values[0]:.1%}-{values[-1]:.1%})"


def _compile_times(tokenizer, vocab: int, schema: dict) -> str:
    """Compile times of a few constraints on a fresh compiler (its cache empty) for this vocabulary,
    and the time xgrammar takes to read the vocabulary (done once per tokenizer in a process)."""
    import xgrammar

    from minipaged_ops.integration import StructuredOutputsParams
    from minipaged_ops.integration.engine.structured_outputs import GrammarCompilerCache

    started = time.perf_counter()
    xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab)
    info_s = time.perf_counter() - started
    cache = GrammarCompilerCache(tokenizer, vocab)
    kinds = {"schema": StructuredOutputsParams(json=schema), "json_object": StructuredOutputsParams(json_object=True),
             "regex": StructuredOutputsParams(regex=r"[a-z]{2,8}@[a-z]{2,8}\.(com|org)"),
             "choice": StructuredOutputsParams(choice=["yes", "no", "maybe"])}
    for params in kinds.values():
        cache.compile(params)
    times = ", ".join(f"{k} {s * 1e3:.0f} ms" for k, s in zip(kinds, cache.compile_seconds))
    return f"compile on a fresh compiler, vocabulary {vocab}: {times} (reading the vocabulary: {info_s:.1f} s, " \
           f"once per tokenizer)"
