"""``SamplingParams``: how to sample one request (vLLM's names and meanings)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

__all__ = ["SamplingParams"]


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one request. ``temperature=0`` is greedy; ``top_k=0`` and ``top_p=1`` turn
    those filters off; ``seed`` gives the request its own generator (completion ``i`` of ``n``
    draws from seed ``seed + i``); ``logprobs=k`` returns, per token, the ``k`` most likely tokens'
    log-probabilities and the chosen one's. ``ignore_eos``: EOS may still be sampled; it just does
    not end the request."""

    n: int = 1
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: Optional[int] = None
    max_tokens: int = 16
    stop_token_ids: Sequence[int] = ()
    ignore_eos: bool = False
    logprobs: Optional[int] = None
    prompt_logprobs: Optional[int] = None

    def __post_init__(self):
        def is_int(x):
            return isinstance(x, int) and not isinstance(x, bool)

        if not is_int(self.n) or self.n < 1:
            raise ValueError(f"SamplingParams: n must be an int >= 1, got {self.n!r}")
        if isinstance(self.temperature, bool) or not isinstance(self.temperature, (int, float)) \
                or not 0 <= self.temperature < math.inf:
            raise ValueError(f"SamplingParams: temperature must be a finite number >= 0, got {self.temperature!r}")
        if isinstance(self.top_p, bool) or not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise ValueError(f"SamplingParams: top_p must be in (0, 1], got {self.top_p!r}")
        if not is_int(self.top_k) or self.top_k < 0:
            raise ValueError(f"SamplingParams: top_k must be an int >= 0 (0: off), got {self.top_k!r}")
        if self.seed is not None and not is_int(self.seed):
            raise ValueError(f"SamplingParams: seed must be an int or None, got {self.seed!r}")
        if not is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"SamplingParams: max_tokens must be an int >= 1, got {self.max_tokens!r}")
        try:
            stops = tuple(self.stop_token_ids)
        except TypeError:
            raise ValueError(f"SamplingParams: stop_token_ids must be a sequence of ints, got {self.stop_token_ids!r}") from None
        if not all(is_int(t) and t >= 0 for t in stops):
            raise ValueError(f"SamplingParams: stop_token_ids must be non-negative ints, got {self.stop_token_ids!r}")
        object.__setattr__(self, "stop_token_ids", stops)
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"SamplingParams: ignore_eos must be a bool, got {self.ignore_eos!r}")
        if self.logprobs is not None and (not is_int(self.logprobs) or self.logprobs < 0):
            raise ValueError(f"SamplingParams: logprobs must be an int >= 0 or None, got {self.logprobs!r}")
        if self.prompt_logprobs is not None and (not is_int(self.prompt_logprobs) or not 0 <= self.prompt_logprobs <= 20):
            raise ValueError(f"SamplingParams: prompt_logprobs must be an int in [0, 20] or None, got {self.prompt_logprobs!r}")
