"""Which proposals the target model keeps, and the one token it adds after them.

The rule (Leviathan et al. 2023; Chen et al. 2023): proposal ``d`` at a position is kept with
probability ``min(1, p(d) / q(d))``, where ``p`` is the target's distribution there (after all the
sampler's logits processing) and ``q`` the proposer's; at the first rejection a token is drawn
from ``max(0, p - q)`` normalised, and when all are kept one more from the next ``p``. Every
emitted token is then distributed exactly as without speculation.

With a one-hot proposer (n-gram), the engine applies the rule as :func:`num_accepted`: the
sampler draws the target's own token at every position (argmax for greedy rows) and a proposal
is kept while it agrees, which keeps it with probability ``p(d)`` and otherwise emits a token
drawn from ``p`` without ``d``, normalised. Those are the very tokens decoding without
speculation gives for the same seed. :func:`rejection_sample` is the rule for a proposer with a
distribution of its own (a draft model).

Each uniform number is a pure function of the row's seed and output position (``seeded_draw``),
the acceptance tests from a stream of their own, so a step that is rolled back and redone keeps
and draws the same tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from ..sampling_params import SamplingParams
from ..seeded_draw import draw_uniform

__all__ = ["VerifyRow", "acceptance_uniform", "num_accepted", "rejection_sample", "verify_rows"]

_ACCEPT_STREAM = 0x5851F42D4C957F2D  # xor'ed into the seed: the acceptance tests' own stream


@dataclass(frozen=True)
class VerifyRow:
    """The sampler's view (``SamplingRow``) of one position of a verify chunk: the sequence as if
    the proposals before that position were kept, so penalties, ``min_tokens`` and the draw's
    position are those of that output position."""

    params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_ids: Sequence[int]
    seed: int
    eos_token_ids: frozenset
    matcher: object = None  # structured outputs: the grammar's mask at this position (a FilledMask)


def verify_rows(row, proposals: Sequence[int]) -> list[VerifyRow]:
    """``1 + len(proposals)`` rows: after the sequence's last token, then after each proposal.
    With structured outputs each row carries the grammar's mask at its position (the proposals
    are ones the grammar accepts: ``Speculator.propose``), so the target's distribution there is
    the constrained one, as without speculation."""
    out = list(row.output_ids)
    masks = [None] * (len(proposals) + 1) if row.matcher is None else row.matcher.masks_along(proposals)
    return [VerifyRow(row.params, row.prompt_token_ids, out + list(proposals[:j]), row.seed, row.eos_token_ids, masks[j])
            for j in range(len(proposals) + 1)]


def num_accepted(target_ids: Sequence[int], proposals: Sequence[int]) -> int:
    """How many leading proposals equal the target's choices (``target_ids[j]`` at position j):
    its argmax (greedy) or its seeded draw (the rule with a one-hot ``q``, see the module)."""
    n = 0
    while n < len(proposals) and proposals[n] == target_ids[n]:
        n += 1
    return n


def acceptance_uniform(seed: int, position: int) -> float:
    return draw_uniform(seed ^ _ACCEPT_STREAM, position)


def rejection_sample(target_probs: torch.Tensor, proposals: Sequence[int], seed: int, first_position: int,
                     draft_probs: Optional[torch.Tensor] = None) -> list[int]:
    """The tokens a sampled row emits: the kept proposals and one more.

    ``target_probs``: ``[len(proposals) + 1, vocab]``, row j the target's distribution at output
    position ``first_position + j``; ``draft_probs``: ``[len(proposals), vocab]`` the proposer's,
    None for a one-hot proposer (n-gram)."""
    p = target_probs.double()
    for j, token in enumerate(proposals):
        position = first_position + j
        q_token = 1.0 if draft_probs is None else float(draft_probs[j, token])
        p_token = float(p[j, token])
        if acceptance_uniform(seed, position) * q_token < p_token:  # u < p/q without dividing by q = 0
            continue
        residual = p[j].clone()
        if draft_probs is None:
            residual[token] = 0.0
        else:
            residual = (residual - draft_probs[j].double()).clamp_(min=0.0)
        if not float(residual.sum()) > 0:  # p == q: a rejection has probability 0; only rounding gets here
            residual = p[j]
        return list(proposals[:j]) + [_inverse_cdf(residual, draw_uniform(seed, position))]
    return list(proposals) + [_inverse_cdf(p[len(proposals)], draw_uniform(seed, first_position + len(proposals)))]


def _inverse_cdf(weights: torch.Tensor, uniform: float) -> int:
    """The token whose cumulative weight first exceeds ``uniform`` of the total (never one of
    weight 0)."""
    cdf = weights.cumsum(0)
    total = cdf[-1]
    target = torch.minimum(total * uniform, torch.nextafter(total, torch.zeros_like(total)))
    return int(torch.searchsorted(cdf, target[None], right=True)[0].clamp(max=weights.shape[0] - 1))
