"""The rows of the batch a :class:`~.cache.PagedKVCache` serves, and the plan of each of its forwards.

Every row of a ``generate()`` batch is one sequence in the block manager. Before each forward the
cache hands the forward's new columns here: the first forward creates the rows' sequences
(identical prompts share all their blocks), later ones append to them, and the step is planned by
the engine's planner (``planner.plan_step``), one chunk per row. A decode step's tensors are
copied into persistent buffers of fixed shape, so a compiled decode step sees the same tensors
every step and is not recompiled. A batch reorder (beam search) forks the sequences of rows
that continue more than once and releases those no row continues, instead of copying any K/V. A
crop (assisted generation's rollback) cuts each row's sequence back by the real tokens among the
columns it removes, so each row's padding columns are remembered.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from minipaged_ops.block_manager import KVBlockManager, OutOfBlocksError

from .planner import ScheduledChunk, StepMetadata, plan_step

__all__ = ["CacheBatch"]


class CacheBatch:
    """The rows' sequences in ``block_manager`` and the planned step.

    ``rows[b]`` is the block-manager sequence id of batch row ``b``; ``step`` is the planner's
    metadata of the forward being prepared (a decode step's on the persistent buffers), and
    ``decoding`` whether that step is a decode step (one token per row).
    """

    def __init__(self, block_manager: KVBlockManager, max_blocks_per_seq: int):
        self.block_manager = block_manager
        self.rows: list[int] = []
        self._pad_columns: list[list[int]] = []  # per row: its padding columns, ascending
        self.step: StepMetadata | None = None
        self.decoding = False
        self._next_seq_id = 0
        self._max_blocks_per_seq = max_blocks_per_seq
        self._block_tables: torch.Tensor | None = None  # int32 [batch, max_blocks_per_seq]
        self._seq_lens: torch.Tensor | None = None  # int32 [batch]
        self._slot_buf: torch.Tensor | None = None  # int64 [batch] (decode slot mapping)

    def reset(self, clear_prefix_cache: bool) -> None:
        """Release every row's sequence (``clear_prefix_cache``: and forget every cached block)."""
        bm = self.block_manager
        if clear_prefix_cache:
            bm.reset()
        else:
            for sid in self.rows:
                bm.release_sequence(sid)
            bm.take_copies()
        self.rows = []
        self._pad_columns = []
        self.decoding = False
        self.step = None

    def start(self, batch, q, tokens, new_real, device) -> None:
        """The first forward of a batch: a sequence per row, of its real (not padding) tokens."""
        bm, bs = self.block_manager, self.block_manager.block_size
        free_before = bm.num_free_blocks
        rows, created, cached_counts = [], [], []
        seen: dict[tuple, int] = {}
        try:
            for b in range(batch):
                cols = [j for j in range(q) if new_real[b][j]]
                toks = [tokens[b][j] for j in cols] if tokens is not None else None
                sid = self._new_seq_id()
                key = tuple(toks) if toks is not None else None
                if key is not None and key in seen:
                    # identical prompt in the batch (num_return_sequences, beams): share every
                    # block, partial last one included; copy-on-write splits them later
                    bm.fork(seen[key], sid)
                    cached_counts.append(len(cols))  # the first copy writes them
                else:
                    cached_counts.append(
                        bm.create_sequence(sid, token_ids=toks, num_tokens=None if toks is not None else len(cols)))
                    if key is not None:
                        seen[key] = sid
                created.append(sid)
                rows.append(sid)
        except OutOfBlocksError as err:
            for sid in created:
                bm.release_sequence(sid)
            bm.take_copies()
            real_tokens = sum(sum(r) for r in new_real)
            needed = sum(math.ceil(sum(r) / bs) for r in new_real)
            raise OutOfBlocksError(
                f"PagedKVCache: prefill of {batch} sequences ({real_tokens} tokens) needs up to {needed} "
                f"blocks of {bs} tokens but {free_before} of {bm.num_blocks} are free; "
                f"build the cache with more blocks ({err})",
                needed=needed,
                free=free_before,
            ) from None
        self.rows = rows
        self._pad_columns = [[j for j in range(q) if not r[j]] for r in new_real]
        self._set_batch_buffers(batch, device)
        self._refresh_tables()
        self._plan_prefill(q, tokens, new_real, cached_counts, device)

    def decode(self, tokens, pool, device) -> None:
        """One token per row: the engine's planner makes the step (every row a one-token chunk),
        whose tensors are then copied into the persistent buffers, so a compiled decode step
        sees the same tensors every step."""
        bm = self.block_manager
        self._check_room([1] * len(self.rows))
        chunks = []
        for b, sid in enumerate(self.rows):
            token = tokens[b][0] if tokens is not None else None
            bm.append_token(sid, token)
            chunks.append(ScheduledChunk(sid, [0 if token is None else token], bm.sequence_length(sid) - 1))
        pool.apply_copies()
        meta = plan_step(bm, chunks, device)
        self._ensure_width(meta.block_tables.shape[1])
        self._slot_buf.copy_(meta.slot_mapping)
        self._seq_lens.copy_(meta.seq_lens)
        self._block_tables[:, : meta.block_tables.shape[1]].copy_(meta.block_tables)
        self.step = dataclasses.replace(
            meta, slot_mapping=self._slot_buf, seq_lens=self._seq_lens, block_tables=self._block_tables
        )
        self.decoding = True

    def extend(self, past, q, tokens, new_real, pool, device) -> None:
        """A later forward of several columns after ``past`` ones (a continued conversation, or
        assisted generation's candidates): append them to every row."""
        bm = self.block_manager
        self._check_room([sum(r) for r in new_real])
        for pads, r in zip(self._pad_columns, new_real):
            pads.extend(past + j for j in range(q) if not r[j])
        for b, sid in enumerate(self.rows):
            cols = [j for j in range(q) if new_real[b][j]]
            toks = [tokens[b][j] for j in cols] if tokens is not None else None
            bm.append_tokens(sid, toks, num_tokens=None if toks is not None else len(cols))
        pool.apply_copies()
        self._refresh_tables()
        self._plan_prefill(q, tokens, new_real, [0] * len(self.rows), device)

    def regather(self, src_rows: list[int]) -> None:
        """New row ``i`` continues old row ``src_rows[i]``: forks where an old row is used more
        than once, releases old rows no longer used."""
        bm, old = self.block_manager, self.rows
        if not old:
            return
        used: set[int] = set()
        new_rows = []
        for src in src_rows:
            if not 0 <= src < len(old):
                raise IndexError(f"PagedKVCache: row index {src} out of range for {len(old)} rows")
            if src in used:
                child = self._new_seq_id()
                bm.fork(old[src], child)
                new_rows.append(child)
            else:
                used.add(src)
                new_rows.append(old[src])
        for j, sid in enumerate(old):
            if j not in used:
                bm.release_sequence(sid)
        self.rows = new_rows
        self._pad_columns = [list(self._pad_columns[src]) for src in src_rows]
        device = self._block_tables.device
        self._set_batch_buffers(len(new_rows), device)
        self._refresh_tables()

    def crop(self, columns: int, remove: int) -> None:
        """Drop the last ``remove`` of ``columns`` columns: each row keeps the real tokens before them."""
        bm, first = self.block_manager, columns - remove
        for sid, pads in zip(self.rows, self._pad_columns):
            kept_pads = sum(1 for c in pads if c < first)
            bm.truncate(sid, bm.sequence_length(sid) - (remove - (len(pads) - kept_pads)))
            del pads[kept_pads:]
        self.decoding = False

    # ------------------------------------------------------------------ helpers

    def _plan_prefill(self, q, tokens, new_real, cached_counts, device) -> None:
        """Prompts or a continuation (a chat turn): each row's real new tokens are one chunk of
        the shared planner, attended over the row's paged history like the engine's prefill
        chunks. Padding columns are not part of the step: ``token_index`` maps the step's packed
        tokens to their places among the forward's ``batch * q`` columns."""
        bm = self.block_manager
        chunks, index = [], []
        for b, sid in enumerate(self.rows):
            cols = [j for j in range(q) if new_real[b][j]]
            if not cols:
                continue  # only padding in this row's new columns
            toks = [tokens[b][j] for j in cols] if tokens is not None else [0] * len(cols)
            chunks.append(ScheduledChunk(sid, toks, bm.sequence_length(sid) - len(cols), cached=cached_counts[b]))
            index.extend(b * q + j for j in cols)
        meta = plan_step(bm, chunks, device)
        if len(index) != len(self.rows) * q:
            meta = dataclasses.replace(meta, token_index=torch.tensor(index, dtype=torch.int64).to(device))
        self.step = meta
        self.decoding = False

    def _new_seq_id(self) -> int:
        self._next_seq_id += 1
        return self._next_seq_id

    def _set_batch_buffers(self, batch: int, device) -> None:
        if self._block_tables is not None and self._block_tables.shape[0] == batch and self._block_tables.device == device:
            return
        self._block_tables = torch.zeros(batch, self._max_blocks_per_seq, dtype=torch.int32, device=device)
        self._seq_lens = torch.zeros(batch, dtype=torch.int32, device=device)
        self._slot_buf = torch.zeros(batch, dtype=torch.int64, device=device)
        for t in (self._block_tables, self._seq_lens, self._slot_buf):
            torch._dynamo.mark_static_address(t)

    def _ensure_width(self, blocks: int) -> None:
        if blocks > self._block_tables.shape[1]:  # longer than max_position_embeddings: grow
            self._max_blocks_per_seq = max(blocks, 2 * self._block_tables.shape[1])
            old = self._block_tables
            self._block_tables = torch.zeros(old.shape[0], self._max_blocks_per_seq, dtype=old.dtype, device=old.device)
            self._block_tables[:, : old.shape[1]] = old
            torch._dynamo.mark_static_address(self._block_tables)

    def _refresh_tables(self) -> None:
        tables, lens = self.block_manager.get_batch_tensors(self.rows)
        self._ensure_width(tables.shape[1])
        self._block_tables.zero_()
        self._block_tables[:, : tables.shape[1]].copy_(tables)
        self._seq_lens.copy_(lens)

    def _check_room(self, counts: list[int]) -> None:
        """Raise OutOfBlocksError, before changing anything, if appending ``counts[i]`` tokens to
        row ``i`` needs more blocks (new blocks plus copy-on-write copies) than are free."""
        bm = self.block_manager
        needed = bm.blocks_needed_to_append([(sid, n) for sid, n in zip(self.rows, counts)])
        free = bm.num_free_blocks
        if needed > free:
            raise OutOfBlocksError(
                f"PagedKVCache: the next step of {len(self.rows)} sequences needs {needed} more blocks of "
                f"{bm.block_size} tokens but {free} of {bm.num_blocks} are free; build the cache with more blocks",
                needed=needed,
                free=free,
            )
