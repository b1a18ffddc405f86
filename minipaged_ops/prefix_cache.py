"""PrefixCache: the content-addressed index of full KV blocks that lets prompts share prefixes.

A full block is keyed by a hash chained over its parent block's key and its own token ids. The
hash only narrows the search: a candidate matches only if its tokens equal the wanted ones and
its parent is the block matched for the preceding tokens (in the same lifetime), so a match of
block ``i`` confirms the whole prefix up to ``i`` by induction, token by token.

Pure bookkeeping over block ids. The pool that owns the blocks
(:class:`~minipaged_ops.block_manager.KVBlockManager`) says when a block starts a new lifetime
(:meth:`PrefixCache.new_lifetime`) and when its contents may no longer be found
(:meth:`PrefixCache.unregister`).

A *chain* is what the next full block of a sequence links to: ``None`` at the start of a
sequence, else the ``(key, identity)`` of the block holding the preceding tokens. It is opaque
to callers; they get it from :meth:`PrefixCache.lookup` or :meth:`PrefixCache.register` and
hand it back.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Optional

__all__ = ["PrefixCache"]


def _chain_hash(parent_hash: Optional[int], tokens: tuple) -> int:
    """Key of a full block: its parent block's key chained with its own tokens.

    A module-level function so tests can force collisions; a hash match is only ever a
    candidate -- hits are confirmed against the tokens (see ``PrefixCache.find``)."""
    return hash((parent_hash, tokens))


# A block's identity for one lifetime: (block id, generation). The generation is bumped every
# time the block is taken from the free pool, so an identity never names two different contents
# and a link to an evicted parent can no longer match.
BlockIdent = tuple


@dataclass
class _BlockMeta:
    """What the index knows of one physical block (key, tokens, parent only while registered)."""

    gen: int = 0  # see BlockIdent
    key: Optional[int] = None  # chained hash while registered, else None
    tokens: Optional[tuple] = None  # this block's token ids (confirmation of a hash match)
    parent: Optional[BlockIdent] = None  # identity of the block holding the preceding tokens


class PrefixCache:
    """Index of registered full blocks of ``block_size`` tokens among ``num_blocks`` blocks."""

    def __init__(self, num_blocks: int, block_size: int):
        self.block_size = block_size
        self._meta = [_BlockMeta() for _ in range(num_blocks)]
        self._index: dict[int, list[int]] = {}  # key -> registered blocks (a list: keys may collide)

    @property
    def num_registered(self) -> int:
        return sum(len(blocks) for blocks in self._index.values())

    def is_registered(self, block: int) -> bool:
        return self._meta[block].key is not None

    def registered_blocks(self) -> Iterator[int]:
        for blocks in self._index.values():
            yield from blocks

    def lookup(self, tokens: list) -> tuple[list[int], Optional[tuple]]:
        """Longest run of registered blocks holding a prompt's leading full blocks, leaving its
        last token out (the model needs that token's logits). Returns the blocks and the chain
        the prompt's next full block links to."""
        bs = self.block_size
        hits: list[int] = []
        key, ident = None, None
        for i in range((len(tokens) - 1) // bs if tokens else 0):
            chunk = tuple(tokens[i * bs:(i + 1) * bs])
            k = _chain_hash(key, chunk)
            b = self.find(k, chunk, ident)
            if b is None:
                break
            hits.append(b)
            key, ident = k, (b, self._meta[b].gen)
        return hits, (None if not hits else (key, ident))

    def find(self, key: int, tokens: tuple, parent: Optional[BlockIdent]) -> Optional[int]:
        """The registered block under ``key`` holding ``tokens`` after block ``parent``, if any."""
        for b in self._index.get(key, ()):
            meta = self._meta[b]
            if meta.tokens == tokens and meta.parent == parent:
                return b
        return None

    def register(self, chain: Optional[tuple], tokens: tuple, block: int) -> tuple:
        """Offer a just-filled ``block`` holding ``tokens`` after ``chain``; returns the chain its
        successor links to.

        If an identical block is already registered, ``block`` stays unregistered (a duplicate)
        and the returned chain names the registered one, since lookups walk registered blocks
        only and must be able to reach the successor."""
        parent_key, parent = chain if chain is not None else (None, None)
        key = _chain_hash(parent_key, tokens)
        b = self.find(key, tokens, parent)
        if b is None:
            b = block
            meta = self._meta[b]
            meta.key, meta.tokens, meta.parent = key, tokens, parent
            self._index.setdefault(key, []).append(b)
        return key, (b, self._meta[b].gen)

    def chain_after(self, tokens: list, blocks: list[int], n: int) -> Optional[tuple]:
        """The chain a sequence's block ``n`` links to, from its first ``n`` full ``blocks`` and
        ``tokens`` (a sequence cut back past blocks it had offered). Walks as :meth:`register`
        answered: the registered block holding each block's tokens, else the sequence's own."""
        bs = self.block_size
        key, ident = None, None
        for i in range(n):
            chunk = tuple(tokens[i * bs:(i + 1) * bs])
            key = _chain_hash(key, chunk)
            b = self.find(key, chunk, ident)
            b = blocks[i] if b is None else b
            ident = (b, self._meta[b].gen)
        return None if n == 0 else (key, ident)

    def unregister(self, block: int) -> None:
        """Make a registered block unfindable (evicted, or holding tokens that were never written)."""
        meta = self._meta[block]
        bucket = self._index[meta.key]
        bucket.remove(block)
        if not bucket:
            del self._index[meta.key]
        meta.key = meta.tokens = meta.parent = None

    def new_lifetime(self, block: int) -> None:
        """The block was taken from the free pool: links to its previous contents go stale."""
        self._meta[block].gen += 1

    def blocks_holding_other_tokens(self, blocks: list[int], tokens: list) -> list[int]:
        """Registered blocks among a sequence's leading full ``blocks`` whose tokens differ from
        the sequence's ``tokens`` (none when the manager is sound)."""
        bs = self.block_size
        return [b for i, b in enumerate(blocks) if self._meta[b].key is not None
                and self._meta[b].tokens != tuple(tokens[i * bs:(i + 1) * bs])]

    def invariant_violations(self) -> list[str]:
        """The index and the per-block records must agree."""
        bad: list[str] = []
        for key, blocks in self._index.items():
            for b in blocks:
                if self._meta[b].key != key:
                    bad.append(f"cache key {key} points at block {b} registered as {self._meta[b].key}")
        if sum(1 for m in self._meta if m.key is not None) != self.num_registered:
            bad.append("registered blocks and cache entries disagree")
        return bad
