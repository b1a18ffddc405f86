"""BlockTables: every live sequence's block table, mirrored into one int32 numpy array.

The kernels take a batch's block tables as one padded int32 ``[batch, width]`` tensor. Keeping
one row per sequence up to date as it grows (one write per new block) makes a decode step's
tensor one fancy-index gather rather than a rebuild from Python lists. Rows are recycled; the
array grows by doubling, so growth is amortised O(1). Entries past a sequence's last block stay
0, a valid block id for padding.

Sequence lengths are not mirrored: a write per token would cost more than reading the batch's
lengths once per step.
"""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["BlockTables"]


class BlockTables:
    def __init__(self):
        self._block_tables = np.zeros((16, 16), dtype=np.int32)
        self._free_rows: list[int] = []
        self._next_row = 0

    def take_row(self) -> int:
        """A zeroed row for a new sequence."""
        if self._free_rows:
            return self._free_rows.pop()
        row = self._next_row
        self._next_row += 1
        if row >= self._block_tables.shape[0]:
            rows = 2 * self._block_tables.shape[0]
            self._block_tables = _grown(self._block_tables, (rows, self._block_tables.shape[1]))
        return row

    def release_row(self, row: int, num_blocks: int) -> None:
        """Zero a row whose sequence held ``num_blocks`` blocks and recycle it."""
        self._block_tables[row, :num_blocks] = 0
        self._free_rows.append(row)

    def clear_from(self, row: int, start: int, end: int) -> None:
        """Zero entries ``start .. end-1`` of a row (its sequence was cut to ``start`` blocks)."""
        self._block_tables[row, start:end] = 0

    def set_block(self, row: int, index: int, block: int) -> None:
        if index >= self._block_tables.shape[1]:
            width = self._block_tables.shape[1]
            while width <= index:
                width *= 2
            self._block_tables = _grown(self._block_tables, (self._block_tables.shape[0], width))
        self._block_tables[row, index] = block

    def copy_row(self, src: int, dst: int) -> None:
        """A forked sequence starts with its parent's table."""
        self._block_tables[dst] = self._block_tables[src]

    def gather(self, rows: list[int], width: int) -> torch.Tensor:
        """Block tables ``[len(rows), width]``, an int32 CPU tensor of its own (a fancy index
        copies), so later updates do not show through."""
        return torch.from_numpy(self._block_tables[rows, :width])

    def row_matches(self, row: int, blocks: list[int]) -> bool:
        """Whether a row holds exactly ``blocks``, then zeros."""
        table = self._block_tables[row]
        n = len(blocks)
        return table[:n].tolist() == blocks and not table[n:].any()


def _grown(arr: np.ndarray, shape: tuple) -> np.ndarray:
    out = np.zeros(shape, dtype=arr.dtype)
    out[tuple(slice(0, s) for s in arr.shape)] = arr
    return out
