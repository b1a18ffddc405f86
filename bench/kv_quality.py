"""8-bit KV caches against the model's own dtype on the engine: greedy agreement and mean KL.

For each format, the same greedy workload runs on an LLMEngine with ``kv_cache_dtype`` set and
on one with "auto". A request agrees when its tokens are equal, or, at the first difference,
each side's token is among the other's 5 most likely (the rule vLLM's tests use in low
precision). The mean KL divergence KL(auto || format) of the next-token distributions is taken
over the steps before each request's first difference (after it, the histories differ).

    python bench/kv_quality.py                     # tiny float32 and bfloat16 models, head_dim 128
"""

from __future__ import annotations

import argparse
import random

import torch

from minipaged_ops.integration import LLMEngine, SamplingParams
from minipaged_ops.tiny import tiny_model

FORMATS = ("int8", "fp8_e4m3", "fp8_e5m2")


def workload(vocab: int, seed: int = 0, count: int = 40):
    """Prompts of 1 to 48 tokens, as the engine tests draw them."""
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(1, 48))] for _ in range(count)]


def run(model, prompts, kv_cache_dtype: str, max_tokens: int, vocab: int):
    """Greedy token ids of each prompt and, per generated token, ``{token id: log-prob}`` over the
    whole vocabulary (recorded from the logits the sampler receives: the engine's ``logprobs``
    stop at 20, vLLM's cap)."""
    engine = LLMEngine(model, num_blocks=512, block_size=16, kv_cache_dtype=kv_cache_dtype,
                       calculate_kv_scales=kv_cache_dtype.startswith("fp8"))
    distributions: dict[str, list[dict[int, float]]] = {}
    sample = engine.sampler

    def recording_sampler(logits, rows):
        for row, logprobs in zip(rows, logits.float().log_softmax(-1).tolist()):  # before the sampler edits logits
            distributions.setdefault(row.request.request_id, []).append(dict(enumerate(logprobs)))
        return sample(logits, rows)

    engine.sampler = recording_sampler
    outs = engine.generate(prompts, SamplingParams(max_tokens=max_tokens), use_tqdm=False)
    for o in outs:
        assert len(distributions[o.request_id]) == len(o.outputs[0].token_ids) and len(distributions[o.request_id][0]) == vocab
    return [(o.outputs[0].token_ids, distributions[o.request_id]) for o in outs]


def compare(reference, outputs, top_k: int = 5) -> dict:
    """Agreement (fraction of requests) and mean KL(reference || outputs) before first differences."""
    agree, kls, exact = 0, [], 0
    for (ref_ids, ref_lp), (ids, lp) in zip(reference, outputs, strict=True):
        first = next((i for i, (a, b) in enumerate(zip(ref_ids, ids)) if a != b), None)
        steps = len(ref_ids) if first is None else first + 1  # the first difference's step shares its history
        for i in range(steps):
            p = torch.tensor([ref_lp[i][t] for t in sorted(ref_lp[i])], dtype=torch.float64)
            q = torch.tensor([lp[i][t] for t in sorted(lp[i])], dtype=torch.float64)
            kls.append(float((p.exp() * (p - q)).sum()))
        if first is None:
            agree, exact = agree + 1, exact + 1
            continue
        top = lambda d: sorted(d, key=d.get, reverse=True)[:top_k]  # noqa: E731
        agree += ids[first] in top(ref_lp[first]) and ref_ids[first] in top(lp[first])
    n = len(reference)
    return dict(agree=agree / n, exact=exact / n, mean_kl=sum(kls) / max(len(kls), 1), steps=len(kls))


def measure(dtype: torch.dtype, *, vocab: int = 192, head_dim: int = 128, max_tokens: int = 16, seed: int = 0,
            count: int = 40) -> dict:
    """{format: compare(...)} for a tiny Qwen3 of ``dtype`` (2 layers, 4 query / 2 kv heads)."""
    model = tiny_model("qwen3", vocab=vocab, dtype=dtype, head_dim=head_dim, hidden=128, heads=4, kv_heads=2,
                       seed=seed)
    prompts = workload(vocab, seed, count)
    reference = run(model, prompts, "auto", max_tokens, vocab)
    return {fmt: compare(reference, run(model, prompts, fmt, max_tokens, vocab)) for fmt in FORMATS}


def parse_args(argv=None, doc: str = __doc__):
    """--requests, --max-tokens, --seeds (bench/weight_quality.py takes the same)."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=40)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--seeds", type=int, default=3, help="models (and workloads) of seeds 0 .. n-1")
    return ap.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    print("format     model dtype  seed  agree (top-5 rule)  exactly equal  mean KL(auto || format)  steps")
    for dtype in (torch.float32, torch.bfloat16):
        for seed in range(args.seeds):
            for fmt, r in measure(dtype, max_tokens=args.max_tokens, seed=seed, count=args.requests).items():
                print(f"{fmt:<10} {str(dtype).removeprefix('torch.'):<12} {seed:<5} {r['agree']:>18.1%}  "
                      f"{r['exact']:>13.1%}  {r['mean_kl']:>23.2e}  {r['steps']:>5}")


if __name__ == "__main__":
    main()
