"""Admission: how many blocks a batch of new prompts or appends would take from the free pool,
answered without changing anything, so a scheduler can decide what fits before it commits.

Read-only arithmetic over the manager's state (:class:`~minipaged_ops.block_manager.KVBlockManager`
builds one per :meth:`~minipaged_ops.block_manager.KVBlockManager.reset` and hands it what it reads:
the reference counts, the prefix cache and a sequence lookup). It lives apart from the manager
because it is the part a scheduler reasons about, and none of it mutates.
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

from .prefix_cache import PrefixCache
from .sequence_state import SequenceState, normalize_tokens

__all__ = ["Admission"]


class Admission:
    def __init__(self, block_size: int, enable_prefix_caching: bool, ref_counts: list[int],
                 prefix_cache: PrefixCache, get_sequence: Callable[[object], SequenceState]):
        # ref_counts is the manager's own list (updated in place, never replaced until reset, which
        # builds a new Admission), read here, never written.
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._ref_counts = ref_counts
        self._prefix_cache = prefix_cache
        self._get_sequence = get_sequence  # raises the manager's KeyError for an unknown id

    def cached_prefix_length(self, token_ids) -> int:
        """Leading tokens of a prompt that ``create_sequence`` would find cached now (a
        multiple of ``block_size``, less than the prompt length; 0 without prefix caching)."""
        tokens, _ = normalize_tokens(token_ids, None)
        if not self.enable_prefix_caching:
            return 0
        return len(self._prefix_cache.lookup(tokens)[0]) * self.block_size

    def blocks_needed_to_allocate(self, prompts: Sequence) -> int:
        """Blocks that creating every prompt (token ids, or a token count) in order takes from
        the free pool: an upper bound, exact for one prompt.

        The first prompt's hits count exactly (a cached-but-free hit comes out of the pool).
        For later prompts only hits on referenced blocks before their first cached-but-free hit
        are certain (an earlier prompt's allocation may evict that block and cut the chain), so
        the rest count as misses; sharing between prompts of the batch is not counted."""
        ref = self._ref_counts
        needed = 0
        for i, prompt in enumerate(prompts):
            if isinstance(prompt, (int, np.integer)) and not isinstance(prompt, bool):
                tokens, n = normalize_tokens(None, prompt)
            else:
                tokens, n = normalize_tokens(prompt, None)
            track = self.enable_prefix_caching and tokens is not None
            hits = self._prefix_cache.lookup(tokens)[0] if track else []
            certain = 0
            for b in hits:
                if ref[b] == 0 and i > 0:
                    break
                certain += 1
            from_pool = sum(1 for b in hits[:certain] if ref[b] == 0)
            needed += -(-n // self.block_size) - certain + from_pool
        return needed

    def blocks_needed_to_append(self, appends) -> int:
        """Blocks that appending ``n`` tokens to each sequence of ``appends`` (pairs
        ``(seq_id, n)``, distinct ids) takes from the free pool: new blocks plus copy-on-write
        copies. Exact, whatever the order of the appends.

        ``k`` sequences appending into one shared last block held ``r`` times copy ``k`` times if
        ``r > k``, else ``k - 1`` times (the last writer owns the block alone by then)."""
        bs, ref = self.block_size, self._ref_counts
        needed = 0
        writers: dict[int, int] = {}  # shared last block -> sequences appending into it
        seen = set()
        for seq_id, n in appends:
            if seq_id in seen:
                raise ValueError(f"appends: sequence {seq_id!r} appears twice")
            seen.add(seq_id)
            if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 0:
                raise ValueError(f"appends: token count for {seq_id!r} must be a non-negative int, got {n!r}")
            seq = self._get_sequence(seq_id)
            if n == 0:
                continue
            needed += -(-(seq.length + n) // bs) - len(seq.blocks)
            if seq.length % bs and ref[seq.blocks[-1]] > 1:
                writers[seq.blocks[-1]] = writers.get(seq.blocks[-1], 0) + 1
        for block, k in writers.items():
            needed += k if ref[block] > k else k - 1
        return needed
