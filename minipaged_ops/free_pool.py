"""FreePool: where a block goes when its last reference goes away, and which free block an
allocation takes next.

An unreferenced block sits in exactly one of three places:

* plain free (FIFO): it holds nothing findable; allocations take these first.
* cached free (LRU): it is still registered in the prefix cache, so a later prompt may find and
  reuse it; when no plain block is left the least recently released one is evicted.
* held back: a copy recorded since the last :meth:`FreePool.take_copies` names it. It rejoins one
  of the other two at that call, so a batch of copies never reuses a source as a destination
  nor a destination twice, and the copies may run in parallel.

Reference counts are the manager's (:class:`~minipaged_ops.block_manager.KVBlockManager`): it
calls :meth:`FreePool.put` when a count drops to zero.
"""

from __future__ import annotations

from collections import OrderedDict, deque

from .prefix_cache import PrefixCache

__all__ = ["FreePool"]


class FreePool:
    def __init__(self, num_blocks: int, prefix_cache: PrefixCache):
        self.num_blocks = num_blocks
        self._prefix_cache = prefix_cache
        self._free = deque(range(num_blocks))
        self._free_cached: OrderedDict[int, None] = OrderedDict()  # oldest release first
        self._copies: list[tuple[int, int]] = []
        self._in_copy: set[int] = set()  # sources and destinations of not-yet-taken copies
        self._deferred: list[int] = []  # released blocks of _in_copy

    @property
    def num_free(self) -> int:
        """Blocks an allocation may take now (cached-free ones included, held-back ones not)."""
        return len(self._free) + len(self._free_cached)

    @property
    def num_cached_free(self) -> int:
        return len(self._free_cached)

    @property
    def num_awaiting_copy(self) -> int:
        return len(self._deferred)

    def take(self) -> int:
        """A free block for new contents: a plain one first, else evict the least recently
        released cached one."""
        if self._free:
            b = self._free.popleft()
        else:
            b, _ = self._free_cached.popitem(last=False)
            self._prefix_cache.unregister(b)
        self._prefix_cache.new_lifetime(b)
        return b

    def claim(self, block: int) -> None:
        """A prefix-cache hit on a block: if it was cached free, it leaves the pool as it is."""
        self._free_cached.pop(block, None)

    def put(self, block: int) -> None:
        """A block whose last reference went away."""
        if block in self._in_copy:
            self._deferred.append(block)
        elif self._prefix_cache.is_registered(block):
            self._free_cached[block] = None  # newest at the end: evicted last
        else:
            self._free.append(block)

    def record_copy(self, src: int, dst: int) -> None:
        self._copies.append((src, dst))
        self._in_copy.update((src, dst))

    def take_copies(self) -> list[tuple[int, int]]:
        """The copies recorded since the last call, in order; held-back blocks rejoin the pool."""
        copies, self._copies = self._copies, []
        self._in_copy.clear()
        for b in self._deferred:
            self.put(b)
        self._deferred.clear()
        return copies

    def invariant_violations(self, ref_counts: list[int]) -> list[str]:
        """Every block is either referenced (``ref_counts``, recounted from the block tables) or
        in exactly one place of the pool, and each place holds only what it should."""
        bad: list[str] = []
        pooled = list(self._free) + list(self._free_cached) + self._deferred
        if len(pooled) != len(set(pooled)):
            bad.append("a block appears twice among the free lists")
        in_pool = set(pooled)
        for b in range(self.num_blocks):
            if (ref_counts[b] > 0) == (b in in_pool):
                bad.append(f"block {b}: referenced {ref_counts[b]} times, in free pool: {b in in_pool}")
        for b in self._free:
            if self._prefix_cache.is_registered(b):
                bad.append(f"block {b} is in the plain free list but still registered")
        for b in self._deferred:
            if b not in self._in_copy:
                bad.append(f"block {b} is held back but no pending copy names it")
        for b in self._prefix_cache.registered_blocks():
            if ref_counts[b] == 0 and b not in self._free_cached:
                bad.append(f"cached block {b} is neither referenced nor cached-free")
        for b in self._free_cached:
            if not self._prefix_cache.is_registered(b):
                bad.append(f"cached-free block {b} is not registered")
        return bad
