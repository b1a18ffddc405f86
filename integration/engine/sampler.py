"""The batched sampler: one call per step turns every row's raw logits into its next token.

Per row: tokens a structured-output constraint forbids are masked (``grammar_matcher``), then
the logits are processed (``logits_processing``: ``min_tokens`` masking, ``logit_bias`` and the
penalties on every row that needs them; temperature, ``min_p``, ``top_k`` and ``top_p`` on the rows
that draw), then greedy rows take the argmax and the others draw (``seeded_draw``: a pure function
of the row's seed and output position). This module assembles the batch: which rows need
processing or a draw, one device-to-host transfer of the chosen tokens, the check that every row
had a token to choose, and the log-probabilities.

Log-probabilities are of the raw model distribution, not of the processed one (``logprobs``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Protocol, Sequence

import torch

from .grammar_matcher import apply_grammar_masks
from .logits_processing import add_logit_bias, apply_penalties, filter_for_draw, index_tensor, mask_stop_tokens
from .logprobs import InvalidLogitsError, prompt_logprobs, top_logprobs
from .sampling_params import SamplingParams
from .seeded_draw import draw_tokens, draw_uniform

__all__ = ["InvalidLogitsError", "SampledToken", "Sampler", "SamplingRow", "draw_uniform", "prompt_logprobs"]


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
    matcher: object  # optional (a SequenceMatcher, or None): the row's structured-output constraint


class Sampler:
    """Chooses each row's next token (the rules and their order: ``logits_processing``, ``seeded_draw``).

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
        apply_grammar_masks(logits, rows)  # structured outputs: in place, before everything below
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
                f"(every logit -inf after the grammar mask and min_tokens masking); nothing was sampled")
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
        apply_grammar_masks(x, rows)
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
            chosen = draw_tokens(x, row_max, rows)
        elif random:
            index = self._index(random)
            drawn = draw_tokens(x.index_select(0, index), row_max.index_select(0, index), [rows[j] for j in random])
            chosen = chosen.index_copy(0, index, drawn)
        return chosen, invalid

    def _transform(self, x: torch.Tensor, rows: list) -> torch.Tensor:
        """min_tokens masking, logit_bias and penalties on every row, temperature and filters on
        the random ones, in place. Returns which rows had NaN or +inf where min_tokens masked."""
        masked_invalid = mask_stop_tokens(x, rows, self.device)
        add_logit_bias(x, rows, self.device)
        apply_penalties(x, rows, self.device)
        random = [j for j, row in enumerate(rows) if not row.params.greedy]
        if len(random) == len(rows):
            filter_for_draw(x, rows, self.device)
        elif random:
            index = self._index(random)
            x.index_copy_(0, index, filter_for_draw(x.index_select(0, index), [rows[j] for j in random], self.device))
        return masked_invalid

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
        return index_tensor(values, self.device)


def _needs_processing(row) -> bool:
    params = row.params
    return not params.greedy or params.has_logits_processing or len(row.output_ids) < params.min_tokens
