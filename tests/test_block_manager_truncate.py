"""KVBlockManager.truncate and provisional appends: what speculative decoding and a cropped cache
need. The random workloads of test_block_manager.py run them against the shadow store too; these
pin the cases one by one."""

import pickle

import pytest

from minipaged_ops import KVBlockManager


def _state(m):
    return pickle.dumps(vars(m))


def test_truncate_frees_the_blocks_past_the_end_last_first_and_zeroes_their_table_entries():
    m = KVBlockManager(4, 4)  # every block used: the highest block id is among those dropped
    m.create_sequence("a", num_tokens=16)
    assert sorted(m.block_table("a")) == [0, 1, 2, 3] and m.num_free_blocks == 0
    table = m.block_table("a")
    m.truncate("a", 5)
    assert m.sequence_length("a") == 5 and m.block_table("a") == table[:2]
    assert m.num_free_blocks == 2 and [m.ref_count(b) for b in table] == [1, 1, 0, 0]
    tables, lens = m.get_batch_tensors(["a"])
    assert tables.tolist() == [table[:2]] and lens.tolist() == [5]
    m.create_sequence("b", num_tokens=8)  # the freed blocks are taken again, last dropped first
    assert m.block_table("b") == [table[3], table[2]]
    assert m.slot_mapping("a") == [table[0] * 4 + p for p in range(4)] + [table[1] * 4]
    m.truncate("a", 0)
    assert m.block_table("a") == [] and m.get_batch_tensors(["a"])[0].tolist() == [[0]]
    assert m.append_token("a") // 4 in (table[0], table[1])  # grows again from nothing
    for sid in ("a", "b"):
        m.release_sequence(sid)
    assert m.num_free_blocks == 4 and m.invariants_ok(), m.invariant_violations()


def test_truncate_into_a_shared_block_copies_it_before_the_next_write():
    m = KVBlockManager(8, 4)
    m.create_sequence("p", num_tokens=7)
    m.fork("p", "c")
    shared = m.block_table("p")
    m.truncate("c", 5)  # c keeps both blocks, the second still shared with p
    assert m.block_table("c") == shared and m.ref_count(shared[1]) == 2
    slot = m.append_token("c")
    (src, dst), = m.take_copies()
    assert src == shared[1] and slot == dst * 4 + 1 and m.block_table("p") == shared
    m.truncate("p", 4)  # p drops its share of the second block; c's copy is its own
    assert m.ref_count(shared[1]) == 0 and m.num_free_blocks == 8 - 2
    assert m.invariants_ok(), m.invariant_violations()


def test_provisional_tokens_are_published_only_once_a_truncate_keeps_them():
    m = KVBlockManager(8, 2, enable_prefix_caching=True)
    m.create_sequence("a", [1, 2, 3])
    m.append_tokens("a", [4, 5, 6, 7], provisional=True)  # fills blocks [3, 4] and [5, 6]
    assert m.cached_prefix_length([1, 2, 3, 4, 5, 6, 7, 0]) == 2  # only the prompt's full block
    m.truncate("a", 5)  # 4 and 5 accepted, 6 and 7 rejected
    assert m.cached_prefix_length([1, 2, 3, 4, 5, 6, 7, 0]) == 4  # [3, 4] confirmed, [5, 6] never
    m.append_tokens("a", [8, 9, 10], provisional=True)
    m.truncate("a", m.sequence_length("a"))  # everything accepted
    assert m.cached_prefix_length([1, 2, 3, 4, 5, 8, 9, 10, 0]) == 8
    assert m.invariants_ok(), m.invariant_violations()


def test_truncate_unpublishes_a_block_it_cuts_and_the_grown_sequence_is_found_again():
    m = KVBlockManager(8, 2, enable_prefix_caching=True)
    m.create_sequence("a", [1, 2, 3, 4, 5, 6, 0])  # blocks [1, 2], [3, 4], [5, 6] published
    table = m.block_table("a")
    m.truncate("a", 3)  # [3, 4] is cut in the middle (kept), [5, 6] dropped
    assert m.cached_prefix_length([1, 2, 3, 4, 5, 6, 0]) == 2
    assert m.usage()["blocks_cached_free"] == 0  # the dropped block went to the plain free list
    m.append_tokens("a", [7, 8, 9])  # rewrites the kept block from position 3 on
    assert m.block_table("a")[:2] == table[:2]
    assert m.cached_prefix_length([1, 2, 3, 7, 8, 9, 0]) == 6  # chained from the kept head
    m.release_sequence("a")
    assert m.create_sequence("b", [1, 2, 3, 7, 8, 9, 0]) == 6
    assert m.invariants_ok(), m.invariant_violations()


def test_a_block_another_sequence_holds_stays_published():
    m = KVBlockManager(8, 2, enable_prefix_caching=True)
    m.create_sequence("a", [1, 2, 3, 4, 0])
    assert m.create_sequence("b", [1, 2, 3, 4, 9]) == 4  # b holds a's two full blocks
    m.truncate("a", 1)
    assert m.cached_prefix_length([1, 2, 3, 4, 7]) == 4  # still b's tokens, still findable
    m.append_token("a", 5)  # a's kept block is shared with b: copied, never rewritten in place
    assert len(m.take_copies()) == 1
    assert m.cached_prefix_length([1, 2, 3, 4, 7]) == 4 and m.invariants_ok(), m.invariant_violations()


@pytest.mark.parametrize("bad", [-1, 8, 2.0, True, None])
def test_bad_lengths_are_refused_and_change_nothing(bad):
    m = KVBlockManager(8, 4, enable_prefix_caching=True)
    m.create_sequence("a", list(range(7)))
    before = _state(m)
    with pytest.raises(ValueError, match=r"length must be an int in \[0, 7\]"):
        m.truncate("a", bad)
    assert _state(m) == before
    with pytest.raises(KeyError, match="'x'"):
        m.truncate("x", 0)


def test_a_published_block_cut_into_is_unpublished_once_its_last_other_holder_leaves():
    # the fuzz run found it: "a" is cut back into a block "b" shares; b leaves; a's next append
    # writes into that block in place (no one else reads it), so it must leave the prefix cache
    m = KVBlockManager(8, 2, enable_prefix_caching=True)
    m.create_sequence("a", [1, 2, 3, 4, 0])
    m.create_sequence("b", [1, 2, 3, 4, 9])  # shares a's two full blocks
    m.truncate("a", 3)
    m.release_sequence("b")
    m.append_token("a", 7)  # in place: a alone holds the block now
    assert m.take_copies() == []
    assert m.cached_prefix_length([1, 2, 3, 4, 0]) == 2 and m.cached_prefix_length([1, 2, 3, 7, 0]) == 4
    assert m.invariants_ok(), m.invariant_violations()
