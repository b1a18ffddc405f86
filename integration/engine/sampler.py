"""The batched sampler: one call per step turns every row's raw logits into its next token.

Per row, in vLLM's order: ``min_tokens`` masking (EOS and ``stop_token_ids`` set to -inf while the
output is shorter than ``min_tokens``), the repetition penalty (over prompt and output), the
frequency and presence penalties (over the output); then greedy rows take the argmax, and the
others are divided by their temperature, filtered by ``min_p``, ``top_k`` and ``top_p`` and drawn.
Each of these runs once over the whole batch with per-row parameter tensors; the penalties touch
only the (row, token) pairs that occur, found by one ``torch.unique`` over the batch's token ids.

A row's draw is a pure function of ``(row.seed, len(row.output_ids))``: one uniform number from a
counter-based hash of the two, turned into a token by inverse CDF over the filtered distribution,
so a step that is rolled back or recomputed draws the same tokens, and no generator state is kept.

Log-probabilities are of the raw model distribution, not of the processed one (``logprobs``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Protocol, Sequence

import torch

from .logprobs import InvalidLogitsError, prompt_logprobs, top_logprobs
from .sampling_params import SamplingParams

__all__ = ["InvalidLogitsError", "SampledToken", "Sampler", "SamplingRow", "draw_uniform", "prompt_logprobs"]

_MASK64 = (1 << 64) - 1
_DRAW_BLOCK = 1024  # tokens per block of the two-level inverse CDF
_EXP_FLOOR = -87.0
_NUCLEUS_CANDIDATES = 1024  # top_p looks for the nucleus among this many most likely tokens first


@dataclass(frozen=True)
class SampledToken:
    token_id: int
    logprobs: Optional[dict[int, float]] = None  # raw model log-probs: the top k and the chosen token


class SamplingRow(Protocol):
    """What the sampler reads of a row (the engine's sequence satisfies it)."""

    params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_ids: Sequence[int]  # generated so far, before this token
    seed: int  # the draw at output position p is a pure function of (seed, p)
    eos_token_ids: frozenset


def _mix64(x: int) -> int:
    """splitmix64's step: a bijection of 64-bit ints in which every input bit moves every output bit."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def draw_uniform(seed: int, position: int) -> float:
    """The uniform number in [0, 1) behind the draw at output ``position`` of a row seeded ``seed``."""
    return (_mix64(_mix64(seed & _MASK64) ^ position) >> 11) * 2.0 ** -53


class Sampler:
    """Chooses each row's next token (see the module docstring for the rules and their order).

    Args:
        vocab_size: tokens that can be chosen; wider logits (a padded lm_head) are cut to it.
        device: where the logits live; per-row parameter tensors are made there.
    """

    def __init__(self, vocab_size: int, device):
        if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 1:
            raise ValueError(f"Sampler: vocab_size must be a positive int, got {vocab_size!r}")
        self.vocab_size = vocab_size
        self.device = torch.device(device)

    def __call__(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> list[SampledToken]:
        """``logits``: [len(rows), >= vocab_size] raw model logits, any float dtype. float32 logits
        are processed in place (a step's logits are used once; this saves a copy of [rows, vocab]),
        after the raw log-probabilities are taken. Raises :class:`InvalidLogitsError` (naming the
        rows) when a row has NaN or +inf logits or no token left to choose."""
        rows = list(rows)
        logits = self._cut(logits, len(rows), "logits")
        if not rows:
            return []
        wanted = [i for i, row in enumerate(rows) if row.params.logprobs is not None]
        raw_logprobs = logits.index_select(0, self._index(wanted)).float().log_softmax(-1) if wanted else None
        processed = [i for i, row in enumerate(rows) if _needs_processing(row)]
        if len(processed) < len(rows):  # greedy rows as they are: the raw argmax (NaN, +inf show in the max)
            row_max, token_ids = logits.max(dim=-1)
            invalid = ~torch.isfinite(row_max)
        if processed:
            everyone = len(processed) == len(rows)
            index = self._index(processed)
            x = logits.float().contiguous() if everyone else logits.index_select(0, index).float()
            chosen, processed_invalid = self._choose(x, [rows[i] for i in processed])
            if everyone:
                token_ids, invalid = chosen, processed_invalid
            else:
                token_ids = token_ids.index_copy(0, index, chosen)
                invalid = invalid.index_copy(0, index, processed_invalid)
        host = torch.cat([token_ids, invalid.long()]).tolist()  # one device-to-host transfer
        token_list, invalid_list = host[:len(rows)], host[len(rows):]
        if any(invalid_list):
            bad = [i for i, flag in enumerate(invalid_list) if flag]
            raise InvalidLogitsError(
                f"Sampler: rows {bad[:8]} of {len(rows)} have NaN or +inf logits or no token left to choose "
                f"(every logit -inf after min_tokens masking); nothing was sampled")
        entries = {}
        if wanted:
            chosen_ids = token_ids.index_select(0, self._index(wanted))
            top = top_logprobs(raw_logprobs, chosen_ids, [rows[i].params.logprobs for i in wanted])
            entries = dict(zip(wanted, top))
        return [SampledToken(token, entries.get(i)) for i, token in enumerate(token_list)]

    def prompt_logprobs(self, logits: torch.Tensor, next_token_ids, num_logprobs) -> list[dict[int, float]]:
        """:func:`prompt_logprobs` on logits cut to the vocabulary."""
        ids = next_token_ids.tolist() if isinstance(next_token_ids, torch.Tensor) else list(next_token_ids)
        return prompt_logprobs(self._cut(logits, len(ids), "prompt logits"), ids, num_logprobs)

    def processed_logits(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
        """The float32 logits each row's choice is made from (a new tensor): greedy rows take their
        argmax, the others draw from their softmax (-inf: filtered out). For inspection and tests."""
        rows = list(rows)
        x = self._cut(logits, len(rows), "logits").float().clone(memory_format=torch.contiguous_format)
        self._transform(x, rows)
        return x

    # ------------------------------------------------------------------ the processed rows

    def _choose(self, x: torch.Tensor, rows: list) -> tuple[torch.Tensor, torch.Tensor]:
        """Tokens of the rows of ``x`` (float32, changed in place), and which rows were invalid."""
        masked_invalid = self._transform(x, rows)
        row_max, chosen = x.max(dim=-1)  # NaN and +inf survive penalties and filters into the max
        invalid = ~torch.isfinite(row_max) | masked_invalid
        random = [j for j, row in enumerate(rows) if not row.params.greedy]
        if len(random) == len(rows):
            chosen = self._draw(x, row_max, rows)
        elif random:
            index = self._index(random)
            drawn = self._draw(x.index_select(0, index), row_max.index_select(0, index), [rows[j] for j in random])
            chosen = chosen.index_copy(0, index, drawn)
        return chosen, invalid

    def _transform(self, x: torch.Tensor, rows: list) -> torch.Tensor:
        """min_tokens masking and penalties on every row, temperature and filters on the random
        ones, in place. Returns which rows had NaN or +inf where min_tokens masked."""
        masked_invalid = self._mask_stop_tokens(x, rows)
        self._apply_penalties(x, rows)
        random = [j for j, row in enumerate(rows) if not row.params.greedy]
        if len(random) == len(rows):
            self._filter(x, rows)
        elif random:
            index = self._index(random)
            x.index_copy_(0, index, self._filter(x.index_select(0, index), [rows[j] for j in random]))
        return masked_invalid

    # The (row, token) pairs below are flat indices into x (contiguous): index_select and
    # index_copy_ on them cost microseconds, where x[rows, tokens] takes milliseconds on a busy CPU.

    def _mask_stop_tokens(self, x: torch.Tensor, rows: list) -> torch.Tensor:
        """min_tokens: EOS and stop_token_ids cannot be chosen while the output is shorter."""
        vocab = x.shape[1]
        keys, key_rows = [], []
        for j, row in enumerate(rows):
            if len(row.output_ids) < row.params.min_tokens:
                banned = [j * vocab + t for t in {*row.eos_token_ids, *row.params.stop_token_ids} if t < vocab]
                keys += banned
                key_rows += [j] * len(banned)
        invalid = torch.zeros(x.shape[0], dtype=torch.bool, device=x.device)
        if keys:
            keys_t, flat = self._index(keys), x.view(-1)
            hidden = flat.index_select(0, keys_t)  # a NaN or +inf about to be masked still makes the row invalid
            bad = (torch.isnan(hidden) | (hidden == math.inf)).to(torch.int64)
            invalid = torch.zeros(x.shape[0], dtype=torch.int64, device=x.device).index_add_(
                0, self._index(key_rows), bad) > 0
            flat.index_fill_(0, keys_t, -math.inf)
        return invalid

    def _apply_penalties(self, x: torch.Tensor, rows: list) -> None:
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
        unique, where = torch.unique(self._index(keys), return_inverse=True)
        counts = torch.zeros(unique.shape[0], device=x.device).index_add_(0, where, self._floats(from_output))
        repetition, frequency, presence = torch.tensor(
            [[r.params.repetition_penalty, r.params.frequency_penalty, r.params.presence_penalty] for r in rows],
            dtype=torch.float32, device=x.device).index_select(0, unique // vocab).unbind(1)
        flat = x.view(-1)
        values = flat.index_select(0, unique)
        values = torch.where(values > 0, values / repetition, values * repetition)
        flat.index_copy_(0, unique, values - frequency * counts - presence * (counts > 0))

    def _filter(self, y: torch.Tensor, rows: list) -> torch.Tensor:
        """Temperature, then min_p and top_k (one floor per row), then top_p, in place on ``y``."""
        vocab = y.shape[1]
        params = [row.params for row in rows]
        y.div_(self._floats([p.temperature for p in params])[:, None])
        top_k = [p.top_k if p.top_k < vocab else 0 for p in params]
        if any(p.min_p > 0 for p in params) or any(top_k):
            # min_p: p_i < min_p * p_max  <=>  y_i < y_max + log(min_p), no softmax needed
            floor = y.amax(-1) + torch.log(self._floats([p.min_p for p in params]))
            if any(top_k):
                k = self._index(top_k)
                kth = y.topk(max(top_k), dim=-1).values.gather(1, (k - 1).clamp(min=0)[:, None])[:, 0]
                floor = torch.maximum(floor, kth.masked_fill(k == 0, -math.inf))
            y.masked_fill_(y < floor[:, None], -math.inf)
        nucleus = [j for j, p in enumerate(params) if p.top_p < 1]
        if nucleus:
            index = self._index(nucleus)
            y.index_copy_(0, index, _top_p(y.index_select(0, index), self._floats([params[j].top_p for j in nucleus])))
        return y

    def _draw(self, y: torch.Tensor, row_max: torch.Tensor, rows: list) -> torch.Tensor:
        """Each row's token by inverse CDF at its uniform number, over weights exp(y - max) (``y``
        is overwritten). Two levels keep it exact and cheap: the CDF over blocks of tokens in
        float64 picks a block, the CDF inside that block picks the token."""
        vocab = y.shape[1]
        weights = _exp_shifted(y, row_max[:, None])
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

    # ------------------------------------------------------------------ helpers

    def _cut(self, logits: torch.Tensor, num_rows: int, what: str) -> torch.Tensor:
        if not isinstance(logits, torch.Tensor) or logits.dim() != 2 or not logits.is_floating_point():
            got = tuple(logits.shape) if isinstance(logits, torch.Tensor) else type(logits).__name__
            raise ValueError(f"Sampler: {what} must be a 2-D float tensor [rows, vocab], got {got}")
        if logits.shape[0] != num_rows or logits.shape[1] < self.vocab_size:
            raise ValueError(f"Sampler: {what} of shape {tuple(logits.shape)} for {num_rows} rows and a vocabulary "
                             f"of {self.vocab_size}: expected [{num_rows}, >= {self.vocab_size}]")
        return logits[:, :self.vocab_size]

    def _index(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=self.device)

    def _floats(self, values: list[float]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.float32, device=self.device)


def _exp_shifted(y: torch.Tensor, top: torch.Tensor) -> torch.Tensor:
    """exp(y - top) in place, where a difference below -87 (past float32's smallest normal, where
    exp takes a slow path 10x slower) gives exactly 0, as -inf does."""
    weights = y.sub_(top).clamp_(min=_EXP_FLOOR).exp_()
    return weights.masked_fill_(weights <= math.exp(_EXP_FLOOR), 0.0)


def _top_p(y: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Keep each row's most likely tokens while the mass above them is below its ``top_p``
    (transformers' rule: drop where the ascending cumulative mass is <= 1 - top_p). A full sort of
    the vocabulary is slow on a CPU, so the nucleus is looked for among the top candidates first;
    rows whose nucleus is wider are sorted in full."""
    candidates = min(_NUCLEUS_CANDIDATES, y.shape[1])
    values, _ = y.topk(candidates, dim=-1)  # descending
    top = values[:, :1]
    mass = (values - top).exp() / _exp_shifted(y.clone(), top).sum(-1, keepdim=True)
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


def _invert(cdf: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row: the first column whose ``cdf`` exceeds ``target`` (held strictly below the row's
    total, so the column has non-zero mass), and how far into that column's mass the target is."""
    total = cdf[:, -1]
    target = torch.minimum(target, torch.nextafter(total, torch.zeros_like(total)))
    column = torch.searchsorted(cdf, target[:, None], right=True)[:, 0].clamp_(max=cdf.shape[1] - 1)
    before = torch.where(column > 0, cdf.gather(1, (column - 1).clamp(min=0)[:, None])[:, 0], 0.0)
    return column, target - before


def _needs_processing(row) -> bool:
    params = row.params
    return not params.greedy or params.has_penalties or len(row.output_ids) < params.min_tokens
