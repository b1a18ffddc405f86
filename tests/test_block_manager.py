"""KVBlockManager: property tests against a shadow KV store, a seeded fuzz run, unit cases.

The shadow model: a Python list stands for the physical cache (one entry per slot). The value
of token ``pos`` of a sequence is an id that names the sequence's whole token prefix up to and
including ``pos`` (interned, so equal prefixes -- and only those -- get equal ids). After every
operation the test applies the manager's copies to the store, writes each new token's value
into the slot the manager gave it, and reads back every live sequence through its block table:
a wrong block table, a missed copy-on-write, a write into a shared block or a false prefix-cache
hit all show up as a sequence reading a value that is not its own history.
"""

import copy
import pickle
import random
from collections import Counter
from unittest import mock

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from minipaged_ops import KVBlockManager, OutOfBlocksError
import minipaged_ops.prefix_cache as prefix_cache

ALPHABET = 3  # few distinct tokens, so prompts share prefixes and the prefix cache gets hits
BASES = [[random.Random(k).randrange(ALPHABET) for _ in range(48)] for k in range(3)]


def weak_hash(parent, tokens):
    """A 2-bit chained hash: collisions everywhere, so only token/parent confirmation keeps
    hits correct (Python's own hash of a tuple practically never collides)."""
    return hash((parent, tokens)) % 4


def snapshot(m: KVBlockManager):
    """Everything the manager holds, by value (to prove a failed call changed nothing)."""
    return pickle.dumps(vars(m))


class Harness:
    """Drives a manager and a shadow store side by side; checks after every operation."""

    def __init__(self, num_blocks, block_size, caching):
        self.m = KVBlockManager(num_blocks, block_size, enable_prefix_caching=caching)
        self.bs, self.caching = block_size, caching
        self.store = [None] * (num_blocks * block_size)
        self.hist = {}  # seq id -> token ids
        self.vals = {}  # seq id -> prefix id of every position
        self.known = {}  # seq id -> whether the manager was given every token id
        self.prefix_ids = {}
        self.next_id = 0
        self.stats = Counter()

    # --- shadow helpers

    def _extend_vals(self, sid, tokens):
        vals = self.vals[sid]
        for t in tokens:
            prev = vals[-1] if vals else -1
            vals.append(self.prefix_ids.setdefault((prev, t), len(self.prefix_ids)))
            self.hist[sid].append(t)

    def _apply_copies(self):
        bs = self.bs
        for src, dst in self.m.take_copies():
            assert src != dst
            self.store[dst * bs:(dst + 1) * bs] = self.store[src * bs:(src + 1) * bs]
            self.stats["copies"] += 1

    def _write(self, sid, pos, slot):
        assert slot == self.m.slot(sid, pos)
        # A write must never land in a block that another sequence still references.
        assert self.m.ref_count(slot // self.bs) == 1, (sid, pos, slot)
        self.store[slot] = self.vals[sid][pos]

    def _pick(self, i):
        ids = sorted(self.hist)
        return ids[i % len(ids)] if ids else None

    # --- operations

    def create(self, base, length, suffix, known):
        sid = self.next_id
        self.next_id += 1
        tokens = BASES[base][:length] + list(suffix)
        n = len(tokens)
        cached = self.m.create_sequence(sid, tokens if known else None,
                                        None if known else n)
        assert cached % self.bs == 0 and 0 <= cached and (cached < n or cached == 0)
        if not (self.caching and known):
            assert cached == 0
        self.stats["hits"] += cached // self.bs
        self.hist[sid], self.vals[sid], self.known[sid] = [], [], known
        self._extend_vals(sid, tokens)
        self._apply_copies()
        slots = self.m.slot_mapping(sid, cached, n)
        for pos, slot in zip(range(cached, n), slots):
            self._write(sid, pos, slot)

    def append(self, i, token, known):
        sid = self._pick(i)
        if sid is None:
            return
        slot = self.m.append_token(sid, token if known else None)
        self._extend_vals(sid, [token])
        self.known[sid] &= known
        self._apply_copies()
        self._write(sid, len(self.hist[sid]) - 1, slot)

    def extend(self, i, tokens):
        sid = self._pick(i)
        if sid is None:
            return
        start = len(self.hist[sid])
        slots = self.m.append_tokens(sid, tokens)
        assert len(slots) == len(tokens)
        self._extend_vals(sid, tokens)
        self._apply_copies()
        for k, slot in enumerate(slots):
            self._write(sid, start + k, slot)

    def fork(self, i):
        parent = self._pick(i)
        if parent is None:
            return
        child = self.next_id
        self.next_id += 1
        self.m.fork(parent, child)
        self.hist[child] = list(self.hist[parent])
        self.vals[child] = list(self.vals[parent])
        self.known[child] = self.known[parent]
        self._apply_copies()

    def release(self, i):
        sid = self._pick(i)
        if sid is None:
            return
        self.m.release_sequence(sid)
        del self.hist[sid], self.vals[sid], self.known[sid]
        self._apply_copies()

    def truncate(self, i, cut):
        """Cut a sequence back by ``cut`` tokens (a cropped cache)."""
        sid = self._pick(i)
        if sid is None:
            return
        keep = max(0, len(self.hist[sid]) - cut)
        self.m.truncate(sid, keep)
        del self.hist[sid][keep:], self.vals[sid][keep:]
        self._apply_copies()

    def speculate(self, i, proposals, accepted):
        """A verify step: provisional proposals written, then all but ``accepted`` taken back.
        Until then, none of the blocks they fill may be found by a prompt."""
        sid = self._pick(i)
        if sid is None:
            return
        start = len(self.hist[sid])
        probe = self.hist[sid] + list(proposals) + [0] if self.known[sid] else None
        found_before = self.m.cached_prefix_length(probe) if probe else 0
        cached_before = self.m.usage()["blocks_cached"]
        slots = self.m.append_tokens(sid, proposals, provisional=True)
        # the append may evict cached blocks for its own, but registers none
        assert self.m.usage()["blocks_cached"] <= cached_before, "a provisional token was published"
        assert not probe or self.m.cached_prefix_length(probe) <= found_before, "a provisional block was found"
        self._extend_vals(sid, proposals)
        self._apply_copies()
        for k, slot in enumerate(slots):
            self._write(sid, start + k, slot)
        keep = start + min(accepted, len(proposals))
        self.m.truncate(sid, keep)
        del self.hist[sid][keep:], self.vals[sid][keep:]
        self.stats["rejected"] += len(proposals) - (keep - start)

    def batch_create(self, prompts):
        """Batch accounting: ``blocks_needed_to_allocate`` bounds what creating the prompts in
        order takes (exactly for one prompt), and ``can_allocate`` promises only what succeeds."""
        m = self.m
        token_lists = [BASES[base][:length] + list(suffix) for base, length, suffix in prompts]
        needed = m.blocks_needed_to_allocate(token_lists)
        trial, ok = copy.deepcopy(m), True
        try:
            for k, tokens in enumerate(token_lists):
                trial.create_sequence(("trial", k), tokens)
        except OutOfBlocksError:
            ok = False
        if ok:
            assert m.num_free_blocks - trial.num_free_blocks <= needed
        if len(token_lists) == 1:
            assert ok == (needed <= m.num_free_blocks)
            if ok:
                assert m.num_free_blocks - trial.num_free_blocks == needed
        if m.can_allocate(token_lists):
            assert ok, (needed, m.num_free_blocks)
            for base, length, suffix in prompts:
                self.create(base, length, suffix, True)

    def batch_append(self, picks, counts):
        """``blocks_needed_to_append`` is exact for any set of distinct sequences, CoW included."""
        ids = sorted(self.hist)
        if not ids:
            return
        chosen = list(dict.fromkeys(ids[i % len(ids)] for i in picks))
        appends = list(zip(chosen, counts))
        needed = self.m.blocks_needed_to_append(appends)
        free = self.m.num_free_blocks
        if not self.m.can_append(appends):
            assert needed > free
            trial = copy.deepcopy(self.m)
            with pytest.raises(OutOfBlocksError):
                for sid, n in appends:
                    trial.append_tokens(sid, [0] * n)
            return
        writes = []
        for sid, n in appends:
            start = len(self.hist[sid])
            writes.append((sid, start, self.m.append_tokens(sid, [1] * n)))
            self._extend_vals(sid, [1] * n)
        assert free - self.m.num_free_blocks == needed
        self._apply_copies()  # the whole batch's copies first, then its writes (one engine step)
        for sid, start, slots in writes:
            for k, slot in enumerate(slots):
                self._write(sid, start + k, slot)

    def step(self, op):
        before = snapshot(self.m)
        try:
            getattr(self, op[0])(*op[1:])
        except OutOfBlocksError as e:
            self.stats["oob"] += 1
            assert isinstance(e, RuntimeError) and e.needed > e.free
            assert f"{e.needed} block" in str(e) and f"{e.free} of" in str(e)
            assert snapshot(self.m) == before, "a failed call changed the manager's state"
        self.check()

    def check(self):
        m, bs = self.m, self.bs
        assert m.invariants_ok(), m.invariant_violations()
        assert sorted(m.sequence_ids()) == sorted(self.hist)
        for sid, vals in self.vals.items():
            table = m.block_table(sid)
            assert m.sequence_length(sid) == len(vals)
            got = [self.store[table[p // bs] * bs + p % bs] for p in range(len(vals))]
            assert got == vals, f"sequence {sid} reads back something other than its history"
        ids = sorted(self.hist)
        if ids:
            tables, lens = m.get_batch_tensors(ids)
            assert tables.dtype == lens.dtype == torch.int32
            assert lens.tolist() == [len(self.vals[s]) for s in ids]
            for row, sid in zip(tables.tolist(), ids):
                table = m.block_table(sid)
                assert row[:len(table)] == table
        u = m.usage()
        assert u["blocks_used"] + u["blocks_free"] + u["blocks_awaiting_copy"] == u["blocks_total"]
        assert u["tokens_logical"] == sum(len(v) for v in self.vals.values())


# ---------------------------------------------------------------- property tests

_seq = st.integers(0, 1000)
_op = st.one_of(
    st.tuples(st.just("create"), st.integers(0, 2), st.integers(0, 40),
              st.lists(st.integers(0, ALPHABET - 1), max_size=6), st.integers(0, 5).map(bool)),
    st.tuples(st.just("append"), _seq, st.integers(0, ALPHABET - 1), st.integers(0, 9).map(bool)),
    st.tuples(st.just("append"), _seq, st.integers(0, ALPHABET - 1), st.just(True)),
    st.tuples(st.just("extend"), _seq, st.lists(st.integers(0, ALPHABET - 1), max_size=20)),
    st.tuples(st.just("fork"), _seq),
    st.tuples(st.just("release"), _seq),
    st.tuples(st.just("batch_create"), st.lists(
        st.tuples(st.integers(0, 2), st.integers(0, 40), st.lists(st.integers(0, ALPHABET - 1), max_size=4)),
        min_size=1, max_size=4)),
    st.tuples(st.just("batch_append"), st.lists(_seq, min_size=1, max_size=6),
              st.lists(st.integers(0, 20), min_size=6, max_size=6)),
    st.tuples(st.just("truncate"), _seq, st.integers(0, 20)),
    st.tuples(st.just("speculate"), _seq, st.lists(st.integers(0, ALPHABET - 1), max_size=9), st.integers(0, 9)),
)


@pytest.mark.parametrize("mode", ["plain", "prefix_cache", "prefix_cache_weak_hash"])
@pytest.mark.parametrize("block_size", [1, 2, 16])
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(num_blocks=st.integers(1, 24), ops=st.lists(_op, max_size=40))
def test_random_workload_matches_shadow(block_size, mode, num_blocks, ops):
    h = Harness(num_blocks, block_size, caching=mode != "plain")
    hash_fn = weak_hash if mode.endswith("weak_hash") else prefix_cache._chain_hash
    with mock.patch.object(prefix_cache, "_chain_hash", hash_fn):
        for op in ops:
            h.step(op)
        for sid in list(h.hist):  # everything returns to the pool once all owners are gone
            h.release(0)
            h.check()
    assert h.m.num_free_blocks == num_blocks
    assert h.m.usage()["blocks_used"] == 0


def _fuzz_op(rng: random.Random):
    r = rng.random()
    tok = lambda: rng.randrange(ALPHABET)  # noqa: E731
    if r < 0.12:
        return ("create", rng.randrange(3), rng.randrange(41),
                [tok() for _ in range(rng.randrange(7))], rng.random() < 0.85)
    if r < 0.60:
        return ("append", rng.randrange(1000), tok(), rng.random() < 0.95)
    if r < 0.68:
        return ("extend", rng.randrange(1000), [tok() for _ in range(rng.randrange(21))])
    if r < 0.80:
        return ("fork", rng.randrange(1000))
    if r < 0.90:
        return ("release", rng.randrange(1000))
    if r < 0.93:
        return ("speculate", rng.randrange(1000), [tok() for _ in range(rng.randrange(9))], rng.randrange(9))
    if r < 0.95:
        return ("truncate", rng.randrange(1000), rng.randrange(12))
    if r < 0.975:
        return ("batch_create", [(rng.randrange(3), rng.randrange(41), [tok() for _ in range(rng.randrange(4))])
                                 for _ in range(rng.randrange(1, 4))])
    return ("batch_append", [rng.randrange(1000) for _ in range(rng.randrange(1, 6))],
            [rng.randrange(9) for _ in range(6)])


@pytest.mark.parametrize("block_size,num_blocks,hash_fn", [(2, 40, weak_hash), (16, 12, None)],
                         ids=["bs2_weak_hash", "bs16"])
def test_seeded_fuzz_10k_operations(block_size, num_blocks, hash_fn):
    rng = random.Random(20240611 + block_size)
    h = Harness(num_blocks, block_size, caching=True)
    with mock.patch.object(prefix_cache, "_chain_hash", hash_fn or prefix_cache._chain_hash):
        for _ in range(10_000):
            h.step(_fuzz_op(rng))
    # The run must actually exercise the interesting paths, or it proves nothing.
    assert h.stats["hits"] > 0 and h.stats["copies"] > 0 and h.stats["oob"] > 0 and h.stats["rejected"] > 0, h.stats


# ---------------------------------------------------------------- unit tests: acceptance cases

def test_parallel_sampling_from_one_prompt():
    m = KVBlockManager(16, 4)
    m.create_sequence("p", list(range(10)))  # 2 full blocks + 1 block holding 2 tokens
    full, partial = m.block_table("p")[:2], m.block_table("p")[2]
    n = 4
    for k in range(n):
        m.fork("p", f"s{k}")
    assert m.take_copies() == []
    assert m.num_free_blocks == 16 - 3  # forking copies nothing and takes nothing
    for b in full + [partial]:
        assert m.ref_count(b) == n + 1
    # Every sample appends its own first token.
    slots = [m.append_token(f"s{k}", 100 + k) for k in range(n)] + [m.append_token("p", 99)]
    copies = m.take_copies()
    assert len(copies) == n and all(src == partial for src, _ in copies)
    dsts = [dst for _, dst in copies]
    assert len(set(dsts)) == n and partial not in dsts
    assert len(set(slots)) == n + 1  # nobody writes where another sequence writes
    assert slots[-1] == partial * 4 + 2  # the last owner writes in place, no copy
    for b in full:
        assert m.ref_count(b) == n + 1  # full prompt blocks stay shared
    assert m.ref_count(partial) == 1
    for k in range(n):
        assert m.block_table(f"s{k}") == full + [dsts[k]]
    assert m.invariants_ok()


def test_beam_fork_then_divergence_records_copy_on_write():
    m = KVBlockManager(8, 4)
    m.create_sequence("beam0", num_tokens=6)
    shared_full, shared_last = m.block_table("beam0")
    m.fork("beam0", "beam1")
    s1 = m.append_token("beam1")  # beam1 moves off the shared last block
    (src, dst), = m.take_copies()
    assert src == shared_last and dst != shared_last
    assert s1 == dst * 4 + 2
    assert m.take_copies() == []  # taken once
    s0 = m.append_token("beam0")  # now sole owner: writes in place
    assert s0 == shared_last * 4 + 2 and m.take_copies() == []
    for _ in range(3):  # both cross into new blocks: fresh, separate, no copies
        m.append_token("beam0")
        m.append_token("beam1")
    assert m.take_copies() == []
    t0, t1 = m.block_table("beam0"), m.block_table("beam1")
    assert t0[0] == t1[0] == shared_full and m.ref_count(shared_full) == 2
    assert len(set(t0[1:]) | set(t1[1:])) == 4
    m.release_sequence("beam1")
    assert m.ref_count(shared_full) == 1
    assert m.num_free_blocks == 8 - 3
    assert m.invariants_ok()


def test_shared_system_prompt_is_ref_counted_and_returned_to_the_pool():
    bs = 16
    system = [7] * 40  # 2 full blocks + 8 tokens
    m = KVBlockManager(10, bs, enable_prefix_caching=True)
    assert m.create_sequence("alice", system + [1, 2, 3]) == 0
    assert m.create_sequence("bob", system + [4, 5]) == 32  # the two full blocks are hits
    ta, tb = m.block_table("alice"), m.block_table("bob")
    assert ta[:2] == tb[:2] and ta[2] != tb[2]
    assert [m.ref_count(b) for b in ta[:2]] == [2, 2]
    assert m.ref_count(ta[2]) == m.ref_count(tb[2]) == 1
    assert m.usage()["blocks_shared"] == 2
    m.release_sequence("alice")
    assert [m.ref_count(b) for b in ta[:2]] == [1, 1]
    assert m.num_free_blocks == 10 - 3
    m.release_sequence("bob")
    assert m.num_free_blocks == 10 and m.usage()["blocks_used"] == 0
    assert m.usage()["blocks_cached_free"] == 2
    # Still findable after all owners left, until the pool needs the blocks.
    assert m.create_sequence("carol", system + [9]) == 32
    assert m.block_table("carol")[:2] == ta[:2]
    assert m.create_sequence("dave", [8] * 40) == 0
    assert m.invariants_ok()


def test_prefix_hit_confirmed_against_tokens_despite_hash_collisions(monkeypatch):
    monkeypatch.setattr(prefix_cache, "_chain_hash", lambda parent, tokens: 0)  # everything collides
    m = KVBlockManager(32, 2, enable_prefix_caching=True)
    m.create_sequence("a", [1, 1, 2, 2, 0])
    assert m.create_sequence("b", [3, 3, 4, 4, 0]) == 0  # same hash, other tokens: a miss
    assert set(m.block_table("a")).isdisjoint(m.block_table("b"))
    assert m.create_sequence("c", [1, 1, 2, 2, 9]) == 4  # genuine match still hits
    assert m.block_table("c")[:2] == m.block_table("a")[:2]
    # Same tokens in block 1 but a different block 0: the parent link must also match.
    assert m.create_sequence("d", [3, 3, 2, 2, 0]) == 2
    assert m.block_table("d")[0] == m.block_table("b")[0]
    assert m.block_table("d")[1] not in m.block_table("a")
    assert m.invariants_ok()


def test_stale_parent_link_after_eviction_is_not_a_hit(monkeypatch):
    # "s" computes its own copy of a cached block (not registered: a duplicate), so its next
    # block chains to a's block 0. Once that block is evicted and reused for other tokens,
    # the chain must not lead to s's block: it holds the prefix [1, 2, 3, 4], not [7, 8, 3, 4].
    monkeypatch.setattr(prefix_cache, "_chain_hash", lambda parent, tokens: 0)  # only tokens+links decide
    m = KVBlockManager(7, 2, enable_prefix_caching=True)
    m.create_sequence("a", [1, 2, 9])  # blocks 0, 1
    m.create_sequence("s", [1, 2])  # (2-1)//2 = 0 blocks looked up; own block 2
    m.append_token("s", 3)
    m.append_token("s", 4)  # block 3 = [3, 4] registered, parent -> block 0
    x = m.block_table("a")[0]
    m.release_sequence("a")
    m.create_sequence("t", num_tokens=8)  # takes every plain free block
    assert m.num_free_blocks == 1
    m.create_sequence("r", [7, 8])  # evicts block 0, now [7, 8]
    assert m.block_table("r") == [x]
    m.release_sequence("t")
    assert m.create_sequence("q", [7, 8, 3, 4, 5]) == 2
    assert m.block_table("q")[1] not in m.block_table("s")
    assert m.invariants_ok()


def test_lru_reuse_of_cached_free_blocks():
    m = KVBlockManager(4, 2, enable_prefix_caching=True)
    m.create_sequence("a", [1, 2, 0])
    m.create_sequence("b", [3, 4, 0])
    a0, b0 = m.block_table("a")[0], m.block_table("b")[0]
    m.release_sequence("a")
    m.release_sequence("b")  # a's cached block was released first
    m.create_sequence("c", num_tokens=6)  # 2 plain free blocks first, then evicts one cached
    assert a0 in m.block_table("c") and b0 not in m.block_table("c")
    m.release_sequence("c")
    assert m.create_sequence("d", [3, 4, 5]) == 2 and m.block_table("d")[0] == b0
    assert m.create_sequence("e", [1, 2, 5]) == 0


def test_release_evicts_a_sequences_tail_before_its_head():
    # Evicting a chain's head first would strand the rest of the chain (unreachable).
    m = KVBlockManager(3, 2, enable_prefix_caching=True)
    m.create_sequence("a", [1, 2, 3, 4, 5])
    head = m.block_table("a")[0]
    m.release_sequence("a")
    m.create_sequence("b", num_tokens=4)  # the plain free block, then one eviction
    assert head not in m.block_table("b")
    m.release_sequence("b")
    assert m.create_sequence("c", [1, 2, 9]) == 2 and m.block_table("c")[0] == head


def test_blocks_filled_by_append_become_cacheable_only_with_known_tokens():
    m = KVBlockManager(8, 2, enable_prefix_caching=True)
    m.create_sequence("a")
    m.append_tokens("a", [5, 6, 7, 8, 9])
    m.create_sequence("u")
    m.append_tokens("u", num_tokens=3)  # ids unknown: nothing to key on
    m.release_sequence("a")
    m.release_sequence("u")
    assert m.create_sequence("b", [5, 6, 7, 8, 1]) == 4
    m2 = KVBlockManager(8, 2)  # caching off: never a hit
    m2.create_sequence("a", [5, 6, 7, 8, 9])
    assert m2.create_sequence("b", [5, 6, 7, 8, 1]) == 0


def test_release_with_written_drops_unwritten_blocks_from_the_prefix_cache():
    # A failed forward: tokens 0..3 were stored before the step, 4..8 were being written.
    m = KVBlockManager(8, 2, enable_prefix_caching=True)
    m.create_sequence("a", [1, 2, 3, 4])
    m.append_tokens("a", [5, 6, 7, 8, 9])
    before = snapshot(m)
    for bad in (-1, 10, 2.0, True):
        with pytest.raises(ValueError, match="written"):
            m.release_sequence("a", written=bad)
        assert snapshot(m) == before
    m.release_sequence("a", written=5)  # block 2 (tokens 5, 6) was only half written
    assert m.invariants_ok(), m.invariant_violations()
    assert m.create_sequence("b", [1, 2, 3, 4, 5, 6, 7, 8, 0]) == 4


def test_never_reports_the_whole_prompt_cached():
    m = KVBlockManager(8, 2, enable_prefix_caching=True)
    m.create_sequence("a", [1, 2, 3, 4])
    assert m.create_sequence("b", [1, 2, 3, 4]) == 2  # the last block is left to compute
    assert m.create_sequence("c", [1, 2, 3, 4, 5]) == 4


def test_released_copy_source_waits_for_take_copies():
    m = KVBlockManager(4, 4)
    m.create_sequence("p", num_tokens=2)
    m.fork("p", "q")
    (shared,) = m.block_table("p")
    m.append_token("p")  # copy (shared -> new) pending
    m.release_sequence("q")  # shared is now unreferenced but still the source of that copy
    assert m.num_free_blocks == 2 and m.usage()["blocks_awaiting_copy"] == 1
    assert m.invariants_ok()
    m.create_sequence("r", num_tokens=8)  # takes the 2 free blocks, never the held one
    assert shared not in m.block_table("r")
    with pytest.raises(OutOfBlocksError, match="1 more await take_copies"):
        m.create_sequence("s", num_tokens=1)
    assert m.take_copies() == [(shared, m.block_table("p")[0])]
    assert m.num_free_blocks == 1 and m.invariants_ok()


# ---------------------------------------------------------------- unit tests: tensors, usage

def test_batch_tensors_are_int32_padded_and_grow():
    m = KVBlockManager(400, 2)
    for s in range(20):  # more rows and columns than the initial mirror holds
        m.create_sequence(s, num_tokens=s * 3)
    ids = [19, 0, 7]
    tables, lens = m.get_batch_tensors(ids)
    assert tables.dtype == torch.int32 and lens.dtype == torch.int32
    assert tables.shape == (3, 29) and lens.tolist() == [57, 0, 21]
    assert tables[0].tolist() == m.block_table(19)
    assert tables[1].tolist() == [0] * 29
    assert tables[2, :11].tolist() == m.block_table(7) and tables[2, 11:].eq(0).all()
    m.fork(19, "f")
    m.append_token("f")
    t2, l2 = m.get_batch_tensors(["f", 19], device="cpu")
    assert t2[0].tolist() == m.block_table("f") and l2.tolist() == [58, 57]
    assert tables[0].tolist() == m.block_table(19)  # earlier results are copies, not views
    assert m.get_batch_tensors([0])[0].shape == (1, 1)


def test_usage_counts():
    m = KVBlockManager(10, 4)
    m.create_sequence("a", num_tokens=6)
    m.fork("a", "b")
    u = m.usage()
    assert (u["blocks_used"], u["blocks_free"], u["blocks_shared"]) == (2, 8, 2)
    assert (u["tokens_stored"], u["tokens_logical"], u["slots_wasted"]) == (6, 12, 2)
    m.append_token("b")
    u = m.usage()
    assert (u["blocks_used"], u["blocks_shared"], u["tokens_stored"], u["slots_wasted"]) == (3, 1, 9, 3)


# ---------------------------------------------------------------- unit tests: errors

@pytest.mark.parametrize("args", [(0, 16), (8, 0), (-1, 16), (8, 1.5), (True, 16), ("8", 16)])
def test_bad_constructor_arguments(args):
    with pytest.raises(ValueError):
        KVBlockManager(*args)


def test_unknown_and_duplicate_ids():
    m = KVBlockManager(8, 4)
    m.create_sequence("a", num_tokens=3)
    with pytest.raises(ValueError, match="already exists"):
        m.create_sequence("a")
    with pytest.raises(ValueError, match="already exists"):
        m.fork("a", "a")
    for call in (lambda: m.append_token("x"), lambda: m.append_tokens("x", [1]),
                 lambda: m.release_sequence("x"), lambda: m.fork("x", "y"),
                 lambda: m.block_table("x"), lambda: m.sequence_length("x"),
                 lambda: m.get_batch_tensors(["a", "x"]),
                 lambda: m.get_batch_tensors(["x"])):
        with pytest.raises(KeyError, match="'x'"):
            call()
    assert not m.has_sequence("y")
    with pytest.raises(ValueError):
        m.create_sequence("b", [1, 2], num_tokens=3)
    with pytest.raises(ValueError):
        m.create_sequence("b", num_tokens=-1)
    with pytest.raises(ValueError):
        m.ref_count(8)
    m.release_sequence("a")
    with pytest.raises(KeyError):
        m.release_sequence("a")  # double release
    assert m.invariants_ok() and m.num_free_blocks == 8


def test_exhaustion_is_clear_and_changes_nothing():
    m = KVBlockManager(4, 4, enable_prefix_caching=True)
    m.create_sequence("a", list(range(9)))  # 3 blocks
    m.fork("a", "b")
    before = snapshot(m)
    with pytest.raises(OutOfBlocksError, match=r"needs 3 block\(s\) but 1 of 4 are free") as e:
        m.create_sequence("c", num_tokens=10)
    assert isinstance(e.value, RuntimeError) and (e.value.needed, e.value.free) == (3, 1)
    with pytest.raises(OutOfBlocksError, match=r"needs 3 block"):
        m.append_tokens("a", [1] * 8)  # 1 copy-on-write + 2 new blocks, 1 free: all or nothing
    assert snapshot(m) == before and not m.has_sequence("c")
    m.append_token("a", 1)  # copy-on-write takes the last free block
    assert m.num_free_blocks == 0
    m.append_token("b", 1)  # b is now sole owner of the old last block: in place
    m.append_token("a", 2)
    m.append_token("a", 3)  # a's last block is full
    before = snapshot(m)
    with pytest.raises(OutOfBlocksError, match=r"needs 1 block\(s\) but 0 of 4"):
        m.append_token("a", 4)
    assert snapshot(m) == before and m.invariants_ok()


# The audit itself: every test above checks it on healthy managers; these break one thing each
# (reaching into the manager's state, which only a test may do) and expect it named.
def _healthy_manager():
    m = KVBlockManager(8, 4, enable_prefix_caching=True)
    m.create_sequence("a", token_ids=[1, 2, 3, 4, 5, 6])  # one full block (cached) and a partial one
    m.fork("a", "b")
    assert m.invariants_ok(), m.invariant_violations()
    return m


def _break_ref_count(m):
    m._ref[m.block_table("a")[0]] += 1


def _break_block_count(m):
    m._seqs["a"].length += 4  # 10 tokens would need 3 blocks


def _break_block_id(m):
    m._seqs["a"].blocks[-1] = 99


def _break_mirror(m):
    m._seqs["a"].blocks.reverse()  # same blocks, same counts, in the wrong order


def _break_cached_tokens(m):
    m._seqs["b"].tokens[0] = 7  # b claims other tokens than its cached first block holds


@pytest.mark.parametrize("corrupt, message", [
    (_break_ref_count, "reference counts differ"),
    (_break_block_count, "2 blocks for 10 tokens"),
    (_break_block_id, "block id 99 out of range"),
    (_break_mirror, "numpy mirror out of sync"),
    (_break_cached_tokens, "holds other tokens"),
], ids=["ref_count", "block_count", "block_id", "mirror", "cached_tokens"])
def test_the_audit_names_each_broken_invariant(corrupt, message):
    m = _healthy_manager()
    corrupt(m)
    assert not m.invariants_ok()
    assert any(message in v for v in m.invariant_violations()), m.invariant_violations()
