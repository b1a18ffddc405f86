"""Log-probabilities as reported to the user: of the raw model distribution (log_softmax of the
unprocessed logits, vLLM's default), so penalties, temperature and filters change the choice of a
token, not the numbers reported for it.
"""

from __future__ import annotations

from typing import Sequence, Union

import torch

__all__ = ["InvalidLogitsError", "prompt_logprobs", "top_logprobs"]

_PROMPT_LOGPROBS_ROWS = 256  # rows of a prompt chunk turned into log-probabilities at a time (memory)


class InvalidLogitsError(RuntimeError):
    """The model's logits hold NaN or +inf, or leave no token to choose (every one -inf)."""


def prompt_logprobs(logits: torch.Tensor, next_token_ids: Union[Sequence[int], torch.Tensor],
                    num_logprobs: Union[int, Sequence[int]]) -> list[dict[int, float]]:
    """Raw model log-probabilities (log_softmax of ``logits``, float32) of each row's next token.

    Row ``i`` gives ``{next_token_ids[i]: its log-prob, and the num_logprobs[i] (or num_logprobs)
    most likely tokens: theirs}``. For a prompt chunk, row ``i`` holds the logits after prompt token
    ``i`` and ``next_token_ids[i]`` is prompt token ``i + 1``. Raises :class:`InvalidLogitsError`
    on NaN or +inf logits, or a row that is all -inf."""
    ids = torch.as_tensor(next_token_ids, dtype=torch.int64, device=logits.device).reshape(-1)
    if ids.shape[0] != logits.shape[0]:
        raise ValueError(f"prompt_logprobs: {ids.shape[0]} next token ids for {logits.shape[0]} rows of logits")
    counts = [num_logprobs] * ids.shape[0] if isinstance(num_logprobs, int) else list(num_logprobs)
    entries: list[dict[int, float]] = []
    for start in range(0, ids.shape[0], _PROMPT_LOGPROBS_ROWS):  # bounded memory for long chunks
        stop = start + _PROMPT_LOGPROBS_ROWS
        part = logits[start:stop]
        if not bool(torch.isfinite(part.amax(-1)).all()):
            raise InvalidLogitsError("prompt_logprobs: logits hold NaN or +inf, or a row that is all -inf")
        entries += top_logprobs(part.float().log_softmax(-1), ids[start:stop], counts[start:stop])
    return entries


def top_logprobs(logprobs: torch.Tensor, ids: torch.Tensor, counts: list[int]) -> list[dict[int, float]]:
    """Per row: ``{ids[i]: its log-prob}`` and the ``counts[i]`` largest log-probs."""
    own = logprobs.gather(1, ids[:, None])[:, 0].tolist()
    k = min(max(counts, default=0), logprobs.shape[1])  # a vocabulary smaller than the count asked: all of it
    top = logprobs.topk(k, dim=-1) if k else None
    top_ids, top_values = (top.indices.tolist(), top.values.tolist()) if top is not None else ([], [])
    entries = []
    for i, (token, n) in enumerate(zip(ids.tolist(), counts)):
        entry = dict(zip(top_ids[i][:n], top_values[i][:n])) if n else {}
        entry[token] = own[i]
        entries.append(entry)
    return entries
