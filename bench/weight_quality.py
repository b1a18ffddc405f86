"""Weight-only int8 / int4 against the bfloat16 model on the engine: greedy agreement and mean KL,
by bench/kv_quality.py's rule (tokens equal, or at the first difference each side's token among the
other's 5 most likely; KL(bfloat16 || quantized) over the steps up to the first difference).

The model: a tiny Qwen3 (2 layers, hidden 128, 4 / 2 heads of 128) whose linear weights look
trained rather than freshly initialised: heavy-tailed (Student-t, 4 degrees of freedom, so a row's
largest weight is many times its typical one, which is what costs per-channel and per-group scales
their precision) with a few input columns 8x larger (the outlier features trained LLMs have).

    python bench/weight_quality.py                 # 3 seeds, 40 requests, 16 tokens each
"""

from __future__ import annotations

import copy
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import kv_quality  # noqa: E402

from minipaged_ops.integration.weight_quant import quantize_weights  # noqa: E402
from minipaged_ops.tiny import tiny_model  # noqa: E402

QUANTIZATIONS = ("int8", "int4")


@torch.no_grad()
def trained_looking(model, seed: int):
    """Redraw every linear weight: Student-t(4) scaled to the layer's init spread, 1 in 32 input
    columns 8x larger; returns the model."""
    g = torch.Generator().manual_seed(seed)
    for m in model.modules():
        if isinstance(m, torch.nn.Linear):
            w = m.weight
            t = _student_t(w.shape, g)
            t = t * (0.5 / w.shape[1] ** 0.5) / t.std()
            outliers = torch.randperm(w.shape[1], generator=g)[: max(1, w.shape[1] // 32)]
            t[:, outliers] *= 8
            w.copy_(t.to(w.dtype))
    return model


def _student_t(shape, g, df: float = 4.0):
    """Student-t draws from a seeded generator: normal / sqrt(chi2(df) / df)."""
    normal = torch.randn(shape, generator=g, dtype=torch.float64)
    chi2 = torch.randn((*shape, int(df)), generator=g, dtype=torch.float64).square().sum(-1)
    return (normal / (chi2 / df).sqrt()).float()


def measure(*, vocab: int = 192, max_tokens: int = 16, seed: int = 0, count: int = 40) -> dict:
    """{quantization: kv_quality.compare(...)} of the bfloat16 model against its quantized copies."""
    model = trained_looking(tiny_model("qwen3", vocab=vocab, dtype=torch.bfloat16, head_dim=128, hidden=128, heads=4,
                                       kv_heads=2, seed=seed), seed)
    prompts = kv_quality.workload(vocab, seed, count)
    reference = kv_quality.run(model, prompts, "auto", max_tokens, vocab)
    results = {}
    for quantization in QUANTIZATIONS:
        quantized = copy.deepcopy(model)
        quantize_weights(quantized, quantization)
        results[quantization] = kv_quality.compare(reference, kv_quality.run(quantized, prompts, "auto", max_tokens,
                                                                               vocab))
    return results


def main(argv=None) -> None:
    args = kv_quality.parse_args(argv, __doc__)
    print("weights  seed  agree (top-5 rule)  exactly equal  mean KL(bfloat16 || quantized)  steps")
    for seed in range(args.seeds):
        for quantization, r in measure(max_tokens=args.max_tokens, seed=seed, count=args.requests).items():
            print(f"{quantization:<8} {seed:<5} {r['agree']:>18.1%}  {r['exact']:>13.1%}  {r['mean_kl']:>30.2e}  "
                  f"{r['steps']:>5}")


if __name__ == "__main__":
    main()
