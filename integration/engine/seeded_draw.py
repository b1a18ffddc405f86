"""The sampler's seeded draw: each row's token from its processed logits and one uniform number.

A row's draw is a pure function of ``(row.seed, len(row.output_ids))``: one uniform number from a
counter-based hash of the two, turned into a token by inverse CDF over the filtered distribution,
so a step that is rolled back or recomputed draws the same tokens, and no generator state is kept.
"""

from __future__ import annotations

import math

import torch

__all__ = ["draw_tokens", "draw_uniform", "exp_shifted"]

_MASK64 = (1 << 64) - 1
_DRAW_BLOCK = 1024  # tokens per block of the two-level inverse CDF
_EXP_FLOOR = -87.0


def _mix64(x: int) -> int:
    """splitmix64's step: a bijection of 64-bit ints in which every input bit moves every output bit."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def draw_uniform(seed: int, position: int) -> float:
    """The uniform number in [0, 1) behind the draw at output ``position`` of a row seeded ``seed``."""
    return (_mix64(_mix64(seed & _MASK64) ^ position) >> 11) * 2.0 ** -53


def draw_tokens(y: torch.Tensor, row_max: torch.Tensor, rows: list) -> torch.Tensor:
    """Each row's token by inverse CDF at its uniform number, over weights exp(y - max) (``y``
    is overwritten). Two levels keep it exact and cheap: the CDF over blocks of tokens in
    float64 picks a block, the CDF inside that block picks the token."""
    vocab = y.shape[1]
    weights = exp_shifted(y, row_max[:, None])
    whole = vocab - vocab % _DRAW_BLOCK
    block_mass = [weights[:, :whole].unflatten(1, (-1, _DRAW_BLOCK)).sum(-1)] if whole else []
    if whole < vocab:
        block_mass.append(weights[:, whole:].sum(-1, keepdim=True))
    block_cdf = torch.cat(block_mass, 1).double().cumsum(-1)
    uniforms = torch.tensor([draw_uniform(row.seed, len(row.output_ids)) for row in rows],
                            dtype=torch.float64, device=y.device)
    block, rest = _invert(block_cdf, uniforms * block_cdf[:, -1])
    columns = block[:, None] * _DRAW_BLOCK + torch.arange(_DRAW_BLOCK, device=y.device)
    inside = columns < vocab
    in_block = weights.gather(1, columns.clamp(max=vocab - 1)).double().masked_fill(~inside, 0)
    offset, _ = _invert(in_block.cumsum(-1), rest)
    return columns.gather(1, offset[:, None])[:, 0]


def exp_shifted(y: torch.Tensor, top: torch.Tensor) -> torch.Tensor:
    """exp(y - top) in place, where a difference below -87 (past float32's smallest normal, where
    exp takes a slow path 10x slower) gives exactly 0, as -inf does."""
    weights = y.sub_(top).clamp_(min=_EXP_FLOOR).exp_()
    return weights.masked_fill_(weights <= math.exp(_EXP_FLOOR), 0.0)


def _invert(cdf: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row: the first column whose ``cdf`` exceeds ``target`` (held strictly below the row's
    total, so the column has non-zero mass), and how far into that column's mass the target is."""
    total = cdf[:, -1]
    target = torch.minimum(target, torch.nextafter(total, torch.zeros_like(total)))
    column = torch.searchsorted(cdf, target[:, None], right=True)[:, 0].clamp_(max=cdf.shape[1] - 1)
    before = torch.where(column > 0, cdf.gather(1, (column - 1).clamp(min=0)[:, None])[:, 0], 0.0)
    return column, target - before
