"""SequenceState: what the block manager keeps for one live sequence, and how the token ids a
caller passes become the list it keeps.

Its own module because the manager, its admission arithmetic (:mod:`~minipaged_ops.admission`)
and its audit (:mod:`~minipaged_ops.audit`) all read it; only the manager changes it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import torch

__all__ = ["SequenceState", "normalize_tokens"]


@dataclass
class SequenceState:
    """One live sequence."""

    row: int  # row in BlockTables
    blocks: list = field(default_factory=list)  # logical block index -> physical block id
    length: int = 0  # tokens stored
    tokens: Optional[list] = None  # token ids while all are known and caching is on, else None
    num_hashed: int = 0  # leading full blocks already offered to the prefix cache
    chain: Optional[tuple] = None  # the prefix cache's link for the next full block


def normalize_tokens(token_ids, num_tokens) -> tuple[Optional[list], int]:
    if token_ids is None:
        n = 0 if num_tokens is None else num_tokens
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 0:
            raise ValueError(f"num_tokens must be a non-negative int, got {num_tokens!r}")
        return ([] if n == 0 else None), int(n)  # an empty prompt's ids are all known
    if isinstance(token_ids, torch.Tensor):
        if token_ids.dim() != 1:
            raise ValueError(f"token_ids must be 1-D, got shape {tuple(token_ids.shape)}")
        tokens = token_ids.tolist()
    else:
        tokens = [int(t) for t in token_ids]
    if num_tokens is not None and num_tokens != len(tokens):
        raise ValueError(f"num_tokens={num_tokens} but {len(tokens)} token_ids were given")
    return tokens, len(tokens)
