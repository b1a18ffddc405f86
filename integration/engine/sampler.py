"""The sampler: one call per step turns the sampled rows' logits into next tokens.

Every draw is a pure function of the sequence's seed and its output position, so a step that is
rolled back or recomputed after a preemption draws the same token again. Logprobs are of the raw
model distribution (the log-softmax of the logits before temperature, penalties and filters).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Protocol, Sequence

import torch

from .sampling_params import SamplingParams

__all__ = ["SampledToken", "Sampler", "SamplingRow"]


class SamplingRow(Protocol):
    params: SamplingParams
    prompt_token_ids: list[int]
    output_ids: list[int]
    seed: int
    eos_token_ids: frozenset


@dataclass(frozen=True)
class SampledToken:
    token_id: int
    logprobs: Optional[dict[int, float]] = None


class Sampler:
    def __init__(self, vocab_size: int, device):
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self._generator = torch.Generator(device=self.device)

    def __call__(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> list[SampledToken]:
        logits = logits.float()
        if torch.isnan(logits).any():  # a broken forward: the engine rolls the step back
            raise FloatingPointError(f"Sampler: NaN in the logits of {int(torch.isnan(logits).any(-1).sum())} "
                                     f"of {len(rows)} rows")
        greedy = logits.argmax(-1).tolist()
        out = []
        for i, row in enumerate(rows):
            params = row.params
            token = greedy[i] if params.temperature == 0 else self._draw(logits[i], row)
            entry = None
            if params.logprobs is not None:
                logprobs = logits[i].log_softmax(-1)
                entry = {}
                if params.logprobs:
                    top = logprobs.topk(params.logprobs)
                    entry = dict(zip(top.indices.tolist(), top.values.tolist()))
                entry[token] = float(logprobs[token])
            out.append(SampledToken(token, entry))
        return out

    def prompt_logprobs(self, logits: torch.Tensor, targets: list[int], k: int) -> list[dict[int, float]]:
        """Per row of ``logits`` (the positions before ``targets``): ``{token id: log-prob}`` of the
        raw distribution, holding the target token and the ``k`` most likely."""
        logprobs = logits.float().log_softmax(-1)
        own = logprobs.gather(1, torch.tensor(targets, device=logprobs.device)[:, None])[:, 0].tolist()
        top = logprobs.topk(k) if k else None
        out = []
        for j, target in enumerate(targets):
            entry = dict(zip(top.indices[j].tolist(), top.values[j].tolist())) if top is not None else {}
            entry[target] = own[j]
            out.append(entry)
        return out

    def _draw(self, logits: torch.Tensor, row: SamplingRow) -> int:
        params = row.params
        scores = logits / params.temperature
        if params.top_k and params.top_k < scores.shape[-1]:
            kth = scores.topk(params.top_k).values[-1]
            scores = scores.masked_fill(scores < kth, -math.inf)
        if params.top_p < 1:
            sorted_scores, order = scores.sort(descending=True)
            cumulative = sorted_scores.softmax(-1).cumsum(-1)
            drop = cumulative - sorted_scores.softmax(-1) >= params.top_p  # keep the first past top_p
            scores = scores.scatter(0, order, sorted_scores.masked_fill(drop, -math.inf))
        self._generator.manual_seed(_mix(row.seed, len(row.output_ids)))
        return int(torch.multinomial(scores.softmax(-1), 1, generator=self._generator))


def _mix(seed: int, position: int) -> int:
    """A 63-bit seed for the draw at ``position`` of a sequence seeded ``seed`` (splitmix64)."""
    z = (seed * 0x9E3779B97F4A7C15 + position + 1) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return (z ^ (z >> 31)) & 0x7FFFFFFFFFFFFFFF
