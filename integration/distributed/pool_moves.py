"""Keeping every rank's KV pool in step with the driver's.

Only the driver has a block manager; the workers' pools hold the same blocks' K/V for their own
kv heads. Besides the forward's writes, K/V move three ways, all decided by the driver's
scheduler: copy-on-write copies, swaps out to host memory and swaps back in. The driver's pool is a
:class:`DriverKVPool`, which records each move as it makes it; the moves travel with the next
step's broadcast and each worker replays them in the same order (:class:`WorkerMoves`) before its
forward. No forward runs between a move on the driver and its replay, so the blocks a move reads
hold the same tokens on every rank.

A swapped-out sequence's host copy on a worker lives as long as the driver's (``SwappedKV``):
when the driver drops its copy (swapped back in, finished, aborted), a ``drop`` follows.
"""

from __future__ import annotations

import itertools
import weakref

from ..kv_pool import KVPool, SwappedKV

__all__ = ["DriverKVPool", "WorkerMoves"]


class DriverKVPool(KVPool):
    """The driver's pool: a :class:`KVPool` that also records every move for the workers."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._moves: list[tuple] = []
        self._keys = itertools.count()
        self._swap_keys: dict[int, int] = {}  # id(driver's SwappedKV) -> the workers' key

    def take_moves(self) -> list[tuple]:
        """The moves made since the last call, oldest first."""
        moves, self._moves = self._moves, []
        return moves

    def copy_blocks(self, copies) -> None:
        super().copy_blocks(copies)
        self._moves.append(("copy", list(copies)))

    def read_blocks(self, block_ids) -> SwappedKV:
        swapped = super().read_blocks(block_ids)
        key = next(self._keys)
        self._swap_keys[id(swapped)] = key
        self._moves.append(("read", key, list(block_ids)))
        weakref.finalize(swapped, self._dropped, id(swapped))
        return swapped

    def write_blocks(self, block_ids, swapped: SwappedKV, first: int) -> None:
        super().write_blocks(block_ids, swapped, first)
        self._moves.append(("write", self._swap_keys[id(swapped)], list(block_ids), first))

    def _dropped(self, swapped_id: int) -> None:
        self._moves.append(("drop", self._swap_keys.pop(swapped_id)))


class WorkerMoves:
    """Replays the driver's moves on a worker's pool, keeping its own host copies of swaps."""

    def __init__(self, pool: KVPool):
        self.pool = pool
        self.swapped: dict[int, SwappedKV] = {}

    def replay(self, moves) -> None:
        for kind, *args in moves:
            if kind == "copy":
                self.pool.copy_blocks(args[0])
            elif kind == "read":
                key, block_ids = args
                self.swapped[key] = self.pool.read_blocks(block_ids)
            elif kind == "write":
                key, block_ids, first = args
                self.pool.write_blocks(block_ids, self.swapped[key], first)
            elif kind == "drop":
                del self.swapped[args[0]]
            else:
                raise ValueError(f"unknown pool move {kind!r}")
