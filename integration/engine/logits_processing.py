"""The sampler's logits processing, each step run once over the whole batch (float32, in place),
with per-row parameter tensors.

In vLLM's order: ``min_tokens`` masking (EOS and ``stop_token_ids`` set to -inf while the output is
shorter than ``min_tokens``), ``logit_bias`` (added), the repetition penalty (over prompt and output), the frequency and
presence penalties (over the output); then, on the rows that draw, temperature, ``min_p`` and
``top_k`` (one floor per row) and ``top_p``. The penalties touch only the (row, token) pairs that
occur, found by one ``torch.unique`` over the batch's token ids.

The (row, token) pairs are flat indices into x (contiguous): index_select and index_copy_ on them
cost microseconds, where x[rows, tokens] takes milliseconds on a busy CPU.
"""

from __future__ import annotations

import math

import torch

from .seeded_draw import exp_shifted

__all__ = ["add_logit_bias", "apply_penalties", "filter_for_draw", "float_tensor", "index_tensor", "mask_stop_tokens"]

_NUCLEUS_CANDIDATES = 1024  # top_p looks for the nucleus among this many most likely tokens first


def index_tensor(values: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64, device=device)


def float_tensor(values: list[float], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32, device=device)


def mask_stop_tokens(x: torch.Tensor, rows: list, device: torch.device) -> torch.Tensor:
    """min_tokens: EOS and stop_token_ids cannot be chosen while the output is shorter. Returns
    which rows had NaN or +inf where it masked."""
    vocab = x.shape[1]
    keys, key_rows = [], []
    for j, row in enumerate(rows):
        if len(row.output_ids) < row.params.min_tokens:
            banned = [j * vocab + t for t in {*row.eos_token_ids, *row.params.stop_token_ids} if t < vocab]
            keys += banned
            key_rows += [j] * len(banned)
    invalid = torch.zeros(x.shape[0], dtype=torch.bool, device=x.device)
    if keys:
        keys_t, flat = index_tensor(keys, device), x.view(-1)
        hidden = flat.index_select(0, keys_t)  # a NaN or +inf about to be masked still makes the row invalid
        bad = (torch.isnan(hidden) | (hidden == math.inf)).to(torch.int64)
        invalid = torch.zeros(x.shape[0], dtype=torch.int64, device=x.device).index_add_(
            0, index_tensor(key_rows, device), bad) > 0
        flat.index_fill_(0, keys_t, -math.inf)
    return invalid


def add_logit_bias(x: torch.Tensor, rows: list, device: torch.device) -> None:
    """Each row's ``logit_bias`` added to its logits: one index_add over the batch's biased pairs."""
    vocab = x.shape[1]
    keys, biases = [], []
    for j, row in enumerate(rows):
        for token, bias in row.params.logit_bias:
            if token < vocab:  # (the engine refuses ids outside the vocabulary)
                keys.append(j * vocab + token)
                biases.append(bias)
    if keys:
        x.view(-1).index_add_(0, index_tensor(keys, device), float_tensor(biases, device))


def apply_penalties(x: torch.Tensor, rows: list, device: torch.device) -> None:
    """Repetition (prompt + output), then frequency and presence (output), on the occurring
    (row, token) pairs only: one unique over the batch, one gather, one scatter."""
    vocab = x.shape[1]
    keys: list[int] = []  # row * vocab + token, for every token of the prompts and outputs penalized
    from_output: list[float] = []  # 1 where the key's token is an output token (counted)
    for j, row in enumerate(rows):
        params, base = row.params, j * vocab
        for ids, is_output, wanted in ((row.prompt_token_ids, 0.0, params.repetition_penalty != 1),
                                       (row.output_ids, 1.0, params.has_penalties)):
            if wanted:  # ids the logits do not cover cannot be chosen anyway
                new = [base + t for t in ids if t < vocab]
                keys += new
                from_output += [is_output] * len(new)
    if not keys:
        return
    unique, where = torch.unique(index_tensor(keys, device), return_inverse=True)
    counts = torch.zeros(unique.shape[0], device=x.device).index_add_(0, where, float_tensor(from_output, device))
    repetition, frequency, presence = torch.tensor(
        [[r.params.repetition_penalty, r.params.frequency_penalty, r.params.presence_penalty] for r in rows],
        dtype=torch.float32, device=x.device).index_select(0, unique // vocab).unbind(1)
    flat = x.view(-1)
    values = flat.index_select(0, unique)
    values = torch.where(values > 0, values / repetition, values * repetition)
    flat.index_copy_(0, unique, values - frequency * counts - presence * (counts > 0))


def filter_for_draw(y: torch.Tensor, rows: list, device: torch.device) -> torch.Tensor:
    """Temperature, then min_p and top_k (one floor per row), then top_p, in place on ``y``."""
    vocab = y.shape[1]
    params = [row.params for row in rows]
    y.div_(float_tensor([p.temperature for p in params], device)[:, None])
    top_k = [p.top_k if p.top_k < vocab else 0 for p in params]
    if any(p.min_p > 0 for p in params) or any(top_k):
        # min_p: p_i < min_p * p_max  <=>  y_i < y_max + log(min_p), no softmax needed
        floor = y.amax(-1) + torch.log(float_tensor([p.min_p for p in params], device))
        if any(top_k):
            k = index_tensor(top_k, device)
            kth = y.topk(max(top_k), dim=-1).values.gather(1, (k - 1).clamp(min=0)[:, None])[:, 0]
            floor = torch.maximum(floor, kth.masked_fill(k == 0, -math.inf))
        y.masked_fill_(y < floor[:, None], -math.inf)
    nucleus = [j for j, p in enumerate(params) if p.top_p < 1]
    if nucleus:
        index = index_tensor(nucleus, device)
        top_p = float_tensor([params[j].top_p for j in nucleus], device)
        y.index_copy_(0, index, _top_p(y.index_select(0, index), top_p))
    return y


def _top_p(y: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Keep each row's most likely tokens while the mass above them is below its ``top_p``
    (transformers' rule: drop where the ascending cumulative mass is <= 1 - top_p). A full sort of
    the vocabulary is slow on a CPU, so the nucleus is looked for among the top candidates first;
    rows whose nucleus is wider are sorted in full."""
    candidates = min(_NUCLEUS_CANDIDATES, y.shape[1])
    values, _ = y.topk(candidates, dim=-1)  # descending
    top = values[:, :1]
    mass = (values - top).exp() / exp_shifted(y.clone(), top).sum(-1, keepdim=True)
    above = mass.cumsum(-1) - mass  # the mass of the tokens before each candidate
    inside = above[:, -1] + mass[:, -1] >= top_p  # the candidates hold the nucleus
    kept = (above < top_p[:, None]).sum(-1)  # >= 1 (nothing is above the first) unless NaN
    smallest = values.gather(1, (kept - 1).clamp(min=0)[:, None])
    y = y.masked_fill(inside[:, None] & (y < smallest), -math.inf)
    wide = (~inside).nonzero()[:, 0]
    if wide.numel():
        part = y.index_select(0, wide)
        ascending, order = part.sort(dim=-1)
        drop = ascending.softmax(-1).cumsum(-1) <= (1 - top_p.index_select(0, wide))[:, None]
        drop[:, -1] = False  # the most likely token always stays
        y.index_copy_(0, wide, part.masked_fill(drop.scatter(1, order, drop), -math.inf))
    return y
