"""The n-gram (prompt-lookup) proposer: a sequence's next tokens guessed from its own history.

The longest suffix of the sequence, ``prompt_lookup_max`` tokens down to ``prompt_lookup_min``,
that occurred earlier in it (prompt or output) is looked up; the tokens that followed an earlier
occurrence are proposed, up to ``num_speculative_tokens``. Outputs that copy or edit their
prompt (code edits, quotes, summaries) make such matches common; random text makes them rare and
proposes nothing. No model runs, so a proposal costs microseconds.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

__all__ = ["NgramProposer"]


class NgramProposer:
    def __init__(self, num_speculative_tokens: int, prompt_lookup_max: int, prompt_lookup_min: int = 1):
        for name, value in (("num_speculative_tokens", num_speculative_tokens),
                            ("prompt_lookup_max", prompt_lookup_max), ("prompt_lookup_min", prompt_lookup_min)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"speculative_config: {name} must be a positive int, got {value!r}")
        if prompt_lookup_min > prompt_lookup_max:
            raise ValueError(f"speculative_config: prompt_lookup_min ({prompt_lookup_min}) must be at most "
                             f"prompt_lookup_max ({prompt_lookup_max})")
        self.num_speculative_tokens = num_speculative_tokens
        self.prompt_lookup_max = prompt_lookup_max
        self.prompt_lookup_min = prompt_lookup_min

    def propose(self, token_ids: Sequence[int], limit: int | None = None) -> list[int]:
        """At most ``min(num_speculative_tokens, limit)`` tokens to follow ``token_ids``; [] when
        no suffix of ``prompt_lookup_min`` tokens or more occurred before."""
        k = self.num_speculative_tokens if limit is None else min(self.num_speculative_tokens, limit)
        length = len(token_ids)
        if k <= 0 or length <= self.prompt_lookup_min:
            return []
        tokens = np.asarray(token_ids, dtype=np.int64)
        for n in range(min(self.prompt_lookup_max, length - 1), self.prompt_lookup_min - 1, -1):
            # windows over all but the last token: each starts early enough to have a successor,
            # and the suffix itself is never among them
            windows = np.lib.stride_tricks.sliding_window_view(tokens[:-1], n)
            hits = np.flatnonzero((windows == tokens[-n:]).all(axis=1))
            if hits.size:
                # the latest occurrence followed by k tokens (the most recent context), else the
                # earliest, which is followed by the most
                whole = hits[hits + n + k <= length]
                start = int(whole[-1] if whole.size else hits[0]) + n
                return tokens[start:start + k].tolist()
        return []
