"""``PagedLayer``: one decoder layer's view of a :class:`~.cache.PagedKVCache`.

transformers asks a cache's layers for their sequence length and mask sizes, and some of its code
reads ``keys``/``values`` of a layer; the paged cache answers for all its layers at once, so a
layer only passes each question on to the cache that owns it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from . import _compat

if TYPE_CHECKING:
    from .cache import PagedKVCache

__all__ = ["PagedLayer"]


class PagedLayer(_compat.CacheLayerMixin):
    """One decoder layer's view of a :class:`PagedKVCache`; ``keys``/``values`` are the layer's
    block pools ``[num_blocks, num_kv_heads, block_size, head_dim]``. Everything goes through
    the owning cache; this object exists for transformers' per-layer queries."""

    is_compileable = True
    is_sliding = False
    is_croppable = True  # PagedKVCache.crop rolls every layer back at once

    def __init__(self, owner: "PagedKVCache", layer_idx: int):
        super().__init__()
        self._owner = owner
        self.layer_idx = layer_idx

    def lazy_initialization(self, key_states, value_states) -> None:  # pools are made by the cache
        pass

    def update(self, key_states, value_states, *args, **kwargs):
        return self._owner.update(key_states, value_states, self.layer_idx)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self._owner.get_mask_sizes(query_length, self.layer_idx)

    def get_seq_length(self) -> int:
        return self._owner.get_seq_length(self.layer_idx)

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:  # the cache resets everything at once
        pass

    def reorder_cache(self, beam_idx) -> None:  # done by the cache, through the block manager
        pass

