"""KVBlockManager: the metadata plane of the paged KV cache.

Pure bookkeeping, no tensor data. It owns the free pool, the per-sequence block tables,
reference counts, copy-on-write, forking and content-addressed prefix caching of full blocks.
Whenever a block's contents must be duplicated it records a ``(src, dst)`` pair; the caller
fetches them with :meth:`KVBlockManager.take_copies` and performs them with
``torch.ops.minipaged.copy_blocks`` *before* writing the new tokens' keys and values.

Caller's contract for one engine step::

    slots = [m.append_token(s, tok) for s, tok in ...]     # or create_sequence / append_tokens
    copies = m.take_copies()                                # 1. apply these copies first
    if copies: copy_blocks(key_cache, value_cache, torch.tensor(copies, dtype=torch.int64))
    reshape_and_cache(..., slot_mapping=slots)              # 2. then write the new tokens
    bt, sl = m.get_batch_tensors(seq_ids)                   # 3. then attend

Fork a sequence only after the tokens it holds have been written (forward pass done), since a
child's later copy-on-write copies whatever the shared block holds at copy time.

Its parts, one module each: :mod:`~minipaged_ops.free_pool` (where unreferenced blocks wait and
which one an allocation takes), :mod:`~minipaged_ops.prefix_cache` (the index of full blocks by
content), :mod:`~minipaged_ops.block_tables` (the int32 mirror that makes a step's block
tables one gather), :mod:`~minipaged_ops.sequence_state` (what is kept per sequence),
:mod:`~minipaged_ops.admission` (how many blocks a batch would take, answered without changing
anything) and :mod:`~minipaged_ops.audit` (occupancy and the invariant check). This module keeps
sequences, reference counts, copy-on-write and forking.
"""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np
import torch

from .admission import Admission
from .audit import BlockAudit
from .block_tables import BlockTables
from .free_pool import FreePool
from .prefix_cache import PrefixCache
from .sequence_state import SequenceState, normalize_tokens

__all__ = ["KVBlockManager", "OutOfBlocksError"]


class OutOfBlocksError(RuntimeError):
    """The free pool cannot satisfy a request. The manager's state is unchanged."""

    def __init__(self, message: str, *, needed: int, free: int):
        super().__init__(message)
        self.needed = needed
        self.free = free


class KVBlockManager:
    """Allocates fixed-size KV blocks to sequences.

    ``num_blocks`` blocks of ``block_size`` token slots each. Token ``pos`` of a sequence lives in
    physical block ``block_table[pos // block_size]`` at offset ``pos % block_size``; its slot is
    ``block * block_size + offset``.
    """

    def __init__(self, num_blocks: int, block_size: int, *, enable_prefix_caching: bool = False):
        for name, value in (("num_blocks", num_blocks), ("block_size", block_size)):
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        self.num_blocks = int(num_blocks)
        self.block_size = int(block_size)
        self.enable_prefix_caching = bool(enable_prefix_caching)
        self.reset()

    def reset(self) -> None:
        """Drop every sequence, cached prefix and pending copy; all blocks become free."""
        n = self.num_blocks
        self._ref = [0] * n
        self._prefix_cache = PrefixCache(n, self.block_size)
        self._pool = FreePool(n, self._prefix_cache)
        self._block_tables = BlockTables()
        self._seqs: dict = {}
        # The read-only parts get the containers above by reference; they are rebuilt here
        # because reset replaces those containers.
        self._admission = Admission(self.block_size, self.enable_prefix_caching, self._ref,
                                    self._prefix_cache, self._get)
        self._audit = BlockAudit(n, self.block_size, self._seqs, self._ref, self._pool,
                                 self._prefix_cache, self._block_tables)

    # ------------------------------------------------------------------ queries

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation may take now (cached-but-free ones included)."""
        return self._pool.num_free

    def has_sequence(self, seq_id) -> bool:
        return seq_id in self._seqs

    def sequence_ids(self) -> list:
        return list(self._seqs)

    def block_table(self, seq_id) -> list[int]:
        return list(self._get(seq_id).blocks)

    def sequence_length(self, seq_id) -> int:
        return self._get(seq_id).length

    def ref_count(self, block_id: int) -> int:
        if not 0 <= block_id < self.num_blocks:
            raise ValueError(f"block_id must be in [0, {self.num_blocks}), got {block_id}")
        return self._ref[block_id]

    def slot(self, seq_id, pos: int) -> int:
        """Slot of token ``pos`` of a sequence."""
        seq = self._get(seq_id)
        if not 0 <= pos < seq.length:
            raise IndexError(f"pos {pos} out of range for sequence {seq_id!r} of length {seq.length}")
        return seq.blocks[pos // self.block_size] * self.block_size + pos % self.block_size

    def slot_mapping(self, seq_id, start: int = 0, end: Optional[int] = None) -> list[int]:
        """Slots of tokens ``start .. end-1`` (``end`` defaults to the sequence length)."""
        seq = self._get(seq_id)
        end = seq.length if end is None else end
        if not 0 <= start <= end <= seq.length:
            raise IndexError(f"range [{start}, {end}) out of range for sequence {seq_id!r} "
                             f"of length {seq.length}")
        bs, blocks = self.block_size, seq.blocks
        return [blocks[p // bs] * bs + p % bs for p in range(start, end)]

    # ------------------------------------------------------------------ batch accounting

    def cached_prefix_length(self, token_ids) -> int:
        """Leading tokens of a prompt that :meth:`create_sequence` would find cached now (see
        :meth:`Admission.cached_prefix_length <minipaged_ops.admission.Admission.cached_prefix_length>`)."""
        return self._admission.cached_prefix_length(token_ids)

    def blocks_needed_to_allocate(self, prompts: Sequence) -> int:
        """Blocks that creating every prompt (token ids, or a token count) in order takes from
        the free pool: an upper bound, exact for one prompt (see
        :meth:`Admission.blocks_needed_to_allocate <minipaged_ops.admission.Admission.blocks_needed_to_allocate>`)."""
        return self._admission.blocks_needed_to_allocate(prompts)

    def can_allocate(self, prompts: Sequence) -> bool:
        """Whether creating every prompt in order fits in the free pool (see
        :meth:`blocks_needed_to_allocate`)."""
        return self.blocks_needed_to_allocate(prompts) <= self.num_free_blocks

    def blocks_needed_to_append(self, appends) -> int:
        """Blocks that appending ``n`` tokens to each sequence of ``appends`` (pairs
        ``(seq_id, n)``, distinct ids) takes from the free pool, copy-on-write copies included;
        exact (see :meth:`Admission.blocks_needed_to_append <minipaged_ops.admission.Admission.blocks_needed_to_append>`)."""
        return self._admission.blocks_needed_to_append(appends)

    def can_append(self, appends) -> bool:
        """Whether :meth:`blocks_needed_to_append` fits in the free pool."""
        return self.blocks_needed_to_append(appends) <= self.num_free_blocks

    # ------------------------------------------------------------------ sequences

    def create_sequence(self, seq_id, token_ids=None, num_tokens: Optional[int] = None) -> int:
        """Allocate blocks for a prompt. Returns how many leading tokens are already cached.

        The count is a multiple of ``block_size`` and always less than the prompt length (at least
        the last token is left for the caller to compute, since the model needs its logits);
        0 without prefix caching or when token ids are not given. The caller must write the
        keys/values of tokens ``cached .. len-1`` (see :meth:`slot_mapping`).
        """
        if seq_id in self._seqs:
            raise ValueError(f"sequence {seq_id!r} already exists")
        tokens, n = normalize_tokens(token_ids, num_tokens)
        track = self.enable_prefix_caching and tokens is not None
        hits, chain = self._prefix_cache.lookup(tokens) if track else ([], None)

        # Check before mutating anything, so that failure leaves the state unchanged. Hit blocks
        # that are cached-but-free come out of the free pool too.
        new = -(-n // self.block_size) - len(hits)
        from_pool = new + sum(1 for b in hits if self._ref[b] == 0)
        self._check_free(from_pool, f"create sequence {seq_id!r}")

        for b in hits:
            self._pool.claim(b)
            self._ref[b] += 1
        seq = SequenceState(row=self._block_tables.take_row(), tokens=tokens if track else None,
                   num_hashed=len(hits), chain=chain)
        self._seqs[seq_id] = seq
        for b in hits:
            self._push_block(seq, b)
        for _ in range(new):
            self._push_block(seq, self._take_block())
        seq.length = n
        self._register_full_blocks(seq)
        return len(hits) * self.block_size

    def append_token(self, seq_id, token_id: Optional[int] = None, *, provisional: bool = False) -> int:
        """Make room for one more token; returns its slot.

        May record a copy-on-write (see :meth:`take_copies`). Passing ``token_id`` keeps the
        sequence's blocks cacheable; ``None`` stops prefix caching for the rest of it.
        ``provisional``: the token may be taken back (a speculative proposal), so a block it fills
        is not offered to the prefix cache until :meth:`truncate` confirms the tokens kept.
        """
        seq = self._get(seq_id)
        bs = self.block_size
        offset = seq.length % bs
        if offset == 0:  # crossing into a new block: the only time a block is taken
            self._check_free(1, f"append to sequence {seq_id!r}")
            block = self._take_block()
            self._push_block(seq, block)
        else:
            block = seq.blocks[-1]
            if self._ref[block] > 1:  # shared: never write where another sequence reads
                block = self._copy_on_write(seq, seq_id)
            elif self._prefix_cache.is_registered(block):
                # a full block this sequence was cut back into (truncate) while another held it;
                # that one has left, and the slots about to be rewritten must not stay findable
                self._prefix_cache.unregister(block)
        seq.length += 1
        if seq.tokens is not None:
            if token_id is None:
                seq.tokens = None  # later blocks cannot be keyed by content
            else:
                seq.tokens.append(int(token_id))
                if offset == bs - 1 and not provisional:
                    self._register_full_blocks(seq)
        return block * bs + offset

    def append_tokens(self, seq_id, token_ids=None, num_tokens: Optional[int] = None, *,
                      provisional: bool = False) -> list[int]:
        """Append several tokens (e.g. a prompt continuation); returns their slots.

        All-or-nothing: raises OutOfBlocksError before changing anything if the pool is short.
        ``provisional``: as for :meth:`append_token` (speculative proposals, confirmed by
        :meth:`truncate`).
        """
        seq = self._get(seq_id)
        tokens, n = normalize_tokens(token_ids, num_tokens)
        bs = self.block_size
        needed = -(-(seq.length + n) // bs) - len(seq.blocks)
        if n and seq.length % bs and self._ref[seq.blocks[-1]] > 1:
            needed += 1  # the first append will copy-on-write
        self._check_free(needed, f"append {n} tokens to sequence {seq_id!r}")
        if tokens is None:
            return [self.append_token(seq_id) for _ in range(n)]
        return [self.append_token(seq_id, t, provisional=provisional) for t in tokens]

    def truncate(self, seq_id, length: int) -> None:
        """Keep the first ``length`` tokens of a sequence (speculative tokens rejected, a cache
        cropped); blocks past the new end go back to the pool, last first.

        No block holding a dropped token stays findable in the prefix cache unless another
        sequence still holds it (then those tokens are that sequence's own): a kept partial block
        is written again from ``length`` on, and a dropped one held rejected tokens. Full blocks
        up to ``length`` that provisional appends left unpublished are published now, so
        ``truncate(seq_id, sequence_length(seq_id))`` confirms every provisional token."""
        seq = self._get(seq_id)
        if isinstance(length, bool) or not isinstance(length, (int, np.integer)) or not 0 <= length <= seq.length:
            raise ValueError(f"length must be an int in [0, {seq.length}] for sequence {seq_id!r}, got {length!r}")
        bs = self.block_size
        full = length // bs
        for b in seq.blocks[full:seq.num_hashed]:
            if self._ref[b] == 1 and self._prefix_cache.is_registered(b):
                self._prefix_cache.unregister(b)
        if seq.tokens is not None:
            del seq.tokens[length:]
        if seq.num_hashed > full:
            seq.num_hashed = full
            seq.chain = None if seq.tokens is None else self._prefix_cache.chain_after(seq.tokens, seq.blocks, full)
        keep = -(-length // bs)
        dropped = seq.blocks[keep:]
        del seq.blocks[keep:]
        for b in reversed(dropped):  # deeper blocks evicted first, as in release_sequence
            self._ref[b] -= 1
            if self._ref[b] == 0:
                self._pool.put(b)
        self._block_tables.clear_from(seq.row, keep, keep + len(dropped))
        seq.length = length
        self._register_full_blocks(seq)

    def fork(self, parent_id, child_id) -> None:
        """The child shares every block of the parent (reference counted); nothing is copied."""
        parent = self._get(parent_id)
        if child_id in self._seqs:
            raise ValueError(f"sequence {child_id!r} already exists")
        child = SequenceState(row=self._block_tables.take_row(), blocks=list(parent.blocks), length=parent.length,
                     tokens=None if parent.tokens is None else list(parent.tokens),
                     num_hashed=parent.num_hashed, chain=parent.chain)
        self._seqs[child_id] = child
        for b in child.blocks:
            self._ref[b] += 1
        self._block_tables.copy_row(parent.row, child.row)

    def release_sequence(self, seq_id, *, written: Optional[int] = None) -> None:
        """Drop a sequence. Blocks no longer referenced return to the pool (cached ones stay
        findable until the pool needs them).

        ``written``: how many leading tokens had their keys and values stored (default: all). A
        caller whose forward failed passes the count from before that step, so that blocks
        holding tokens that were never written leave the prefix cache instead of being found."""
        seq = self._get(seq_id)
        if written is not None:
            if isinstance(written, bool) or not isinstance(written, (int, np.integer)) or not 0 <= written <= seq.length:
                raise ValueError(f"written must be an int in [0, {seq.length}] for sequence {seq_id!r}, got {written!r}")
            for b in seq.blocks[written // self.block_size:]:
                if self._prefix_cache.is_registered(b):
                    self._prefix_cache.unregister(b)
        del self._seqs[seq_id]
        # Release tail first so that, within one sequence, deeper blocks are evicted before the
        # blocks they chain from (evicting a parent makes its cached children unreachable).
        for b in reversed(seq.blocks):
            self._ref[b] -= 1
            if self._ref[b] == 0:
                self._pool.put(b)
        self._block_tables.release_row(seq.row, len(seq.blocks))

    def take_copies(self) -> list[tuple[int, int]]:
        """(src, dst) block copies recorded since the last call, in order.

        A block named by a pending copy is held out of the pool until this call even if released,
        so a batch never reuses a source as a destination nor a destination twice: the copies
        may run in parallel (given the contract above: no fork between append and copy)."""
        return self._pool.take_copies()

    # ------------------------------------------------------------------ batch tensors

    def get_batch_tensors(self, seq_ids: Sequence, device=None) -> tuple[torch.Tensor, torch.Tensor]:
        """(block_tables, seq_lens) for a batch with one row lookup."""
        seqs = [self._get(s) for s in seq_ids]
        width = max((len(s.blocks) for s in seqs), default=0) or 1  # kernels want >= 1 column
        block_tables = self._block_tables.gather([s.row for s in seqs], width)
        seq_lens = torch.from_numpy(np.fromiter([s.length for s in seqs], np.int32, len(seqs)))
        return _to(block_tables, device), _to(seq_lens, device)

    # ------------------------------------------------------------------ audit

    def usage(self) -> dict:
        """Pool occupancy (see :meth:`BlockAudit.usage <minipaged_ops.audit.BlockAudit.usage>`)."""
        return self._audit.usage()

    def invariants_ok(self) -> bool:
        return not self.invariant_violations()

    def invariant_violations(self) -> list[str]:
        """Human-readable list of broken invariants (empty when all hold)."""
        return self._audit.invariant_violations()

    # ------------------------------------------------------------------ internals

    def _get(self, seq_id) -> SequenceState:
        try:
            return self._seqs[seq_id]
        except KeyError:
            raise KeyError(f"unknown sequence {seq_id!r}") from None

    def _check_free(self, needed: int, what: str) -> None:
        free = self.num_free_blocks
        if needed > free:
            held = self._pool.num_awaiting_copy
            held = f"; {held} more await take_copies()" if held else ""
            raise OutOfBlocksError(
                f"out of KV blocks: {what} needs {needed} block(s) but {free} of "
                f"{self.num_blocks} are free{held}", needed=needed, free=free)

    def _take_block(self) -> int:
        b = self._pool.take()
        self._ref[b] = 1
        return b

    def _copy_on_write(self, seq: SequenceState, seq_id) -> int:
        self._check_free(1, f"copy-on-write for sequence {seq_id!r}")
        old = seq.blocks[-1]
        new = self._take_block()
        self._ref[old] -= 1  # still >= 1: another sequence holds it
        seq.blocks[-1] = new
        self._block_tables.set_block(seq.row, len(seq.blocks) - 1, new)
        self._pool.record_copy(old, new)
        return new

    def _push_block(self, seq: SequenceState, b: int) -> None:
        self._block_tables.set_block(seq.row, len(seq.blocks), b)
        seq.blocks.append(b)

    def _register_full_blocks(self, seq: SequenceState) -> None:
        """Offer the sequence's newly full blocks to the prefix cache."""
        if seq.tokens is None:
            return
        bs = self.block_size
        while seq.num_hashed < seq.length // bs:
            i = seq.num_hashed
            chunk = tuple(seq.tokens[i * bs:(i + 1) * bs])
            seq.chain = self._prefix_cache.register(seq.chain, chunk, seq.blocks[i])
            seq.num_hashed += 1


def _to(t: torch.Tensor, device) -> torch.Tensor:
    return t if device is None else t.to(device)
