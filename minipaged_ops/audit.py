"""BlockAudit: the block manager's occupancy report and its invariant check.

Read-only: engine stats, tests and debugging read it, but no allocation decision does. It lives
apart from :class:`~minipaged_ops.block_manager.KVBlockManager` so the manager's file holds only
what changes state. The manager builds one per ``reset`` and hands it what it reads; every part
it asks is asked through that part's public methods.
"""

from __future__ import annotations

from .block_tables import BlockTables
from .free_pool import FreePool
from .prefix_cache import PrefixCache
from .sequence_state import SequenceState

__all__ = ["BlockAudit"]


class BlockAudit:
    def __init__(self, num_blocks: int, block_size: int, seqs: dict[object, SequenceState],
                 ref_counts: list[int], pool: FreePool, prefix_cache: PrefixCache,
                 block_tables: BlockTables):
        # seqs and ref_counts are the manager's own containers (updated in place, never replaced
        # until reset, which builds a new audit), read here, never written.
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._seqs = seqs
        self._ref_counts = ref_counts
        self._pool = pool
        self._prefix_cache = prefix_cache
        self._block_tables = block_tables

    def usage(self) -> dict:
        """Pool occupancy. ``tokens_stored`` counts distinct filled slots (shared ones once);
        ``tokens_logical`` sums sequence lengths; ``slots_wasted`` are empty slots of used blocks."""
        bs, ref = self.block_size, self._ref_counts
        fill: dict[int, int] = {}
        for seq in self._seqs.values():
            for i, b in enumerate(seq.blocks):
                fill[b] = min(bs, seq.length - i * bs)
        used = sum(1 for r in ref if r > 0)
        stored = sum(fill.values())
        return {
            "blocks_total": self.num_blocks,
            "blocks_used": used,
            "blocks_free": self._pool.num_free,
            "blocks_cached_free": self._pool.num_cached_free,
            "blocks_awaiting_copy": self._pool.num_awaiting_copy,
            "blocks_shared": sum(1 for r in ref if r > 1),
            "blocks_cached": self._prefix_cache.num_registered,
            "sequences": len(self._seqs),
            "tokens_stored": stored,
            "tokens_logical": sum(s.length for s in self._seqs.values()),
            "slots_wasted": used * bs - stored,
        }

    def invariant_violations(self) -> list[str]:
        """Human-readable list of broken invariants (empty when all hold)."""
        bad: list[str] = []
        n, bs, ref = self.num_blocks, self.block_size, self._ref_counts
        refs = [0] * n
        for sid, seq in self._seqs.items():
            if len(seq.blocks) != -(-seq.length // bs):
                bad.append(f"seq {sid!r}: {len(seq.blocks)} blocks for {seq.length} tokens")
            for b in seq.blocks:
                if not 0 <= b < n:
                    bad.append(f"seq {sid!r}: block id {b} out of range")
                else:
                    refs[b] += 1
            if not self._block_tables.row_matches(seq.row, seq.blocks):
                bad.append(f"seq {sid!r}: numpy mirror out of sync")
            if seq.tokens is not None:  # registered blocks must hold the tokens of every user
                for b in self._prefix_cache.blocks_holding_other_tokens(
                        seq.blocks[: seq.length // bs], seq.tokens):
                    bad.append(f"seq {sid!r}: cached block {b} holds other tokens")
        if refs != ref:
            bad.append("reference counts differ from table entries: "
                       f"{[(b, ref[b], refs[b]) for b in range(n) if refs[b] != ref[b]]}")
        bad += self._pool.invariant_violations(refs)
        bad += self._prefix_cache.invariant_violations()
        return bad
