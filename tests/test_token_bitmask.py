"""minipaged_ops.apply_token_bitmask_ (a grammar's allowed-token mask on the CPU) against the
pure-PyTorch reference and xgrammar's own apply, on fresh random masks: all-ones, all-zero and
mixed words, vocabularies off the 32-token grid, bitmasks narrower than the vocabulary, rows left
out of ``indices`` untouched, every logits dtype; bad arguments change nothing."""

from __future__ import annotations

import pytest
import torch

import minipaged_ops
from minipaged_ops import reference


def random_bitmask(rows, words, g):
    """Words drawn from all-ones, all-zero and random bits, a third each."""
    kind = torch.randint(0, 3, (rows, words), generator=g)
    bits = torch.randint(-2**31, 2**31 - 1, (rows, words), generator=g, dtype=torch.int64).to(torch.int32)
    return torch.where(kind == 0, torch.full_like(bits, -1), torch.where(kind == 1, torch.zeros_like(bits), bits))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("vocab, words", [(1, 1), (31, 1), (32, 1), (33, 2), (200, 7), (1000, 32), (90, 2)],
                         ids=str)  # (90, 2): the bitmask covers 64 tokens, the rest are masked
def test_matches_the_reference(dtype, vocab, words):
    g = torch.Generator().manual_seed(vocab * 7 + words)
    logits = torch.randn(6, vocab, generator=g).to(dtype)
    bitmask = random_bitmask(6, words, g)
    indices = torch.tensor([4, 0, 2, 5])  # rows 1 and 3 left alone
    expected = logits.clone()
    reference.apply_token_bitmask_(expected, bitmask, indices)
    minipaged_ops.apply_token_bitmask_(logits, bitmask, indices)
    assert torch.equal(logits, expected)


def test_matches_xgrammar_on_a_real_vocabulary():
    xgrammar = pytest.importorskip("xgrammar")
    vocab, rows = 151936, 5
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(rows, vocab, generator=g)
    bitmask = random_bitmask(rows, -(-vocab // 32), g)
    theirs = logits.clone()
    xgrammar.apply_token_bitmask_inplace(theirs, bitmask, vocab_size=vocab, indices=[0, 3, 4])
    minipaged_ops.apply_token_bitmask_(logits, bitmask, torch.tensor([0, 3, 4]))
    assert torch.equal(logits, theirs)


def test_a_strided_batch_and_no_rows():
    g = torch.Generator().manual_seed(2)
    wide = torch.randn(4, 100, generator=g)
    logits = wide[:, :64]  # rows 100 apart
    bitmask = random_bitmask(4, 2, g)
    expected = logits.clone()
    reference.apply_token_bitmask_(expected, bitmask, torch.tensor([1, 3]))
    minipaged_ops.apply_token_bitmask_(logits, bitmask, torch.tensor([1, 3]))
    assert torch.equal(logits, expected)
    before = logits.clone()
    minipaged_ops.apply_token_bitmask_(logits, bitmask, torch.tensor([], dtype=torch.long))
    assert torch.equal(logits, before)


@pytest.mark.parametrize("args, match", [
    ((torch.randn(2, 8), torch.zeros(2, 1, dtype=torch.int32), torch.tensor([0, 2])), "indices\\[1\\] = 2"),
    ((torch.randn(2, 8), torch.zeros(2, 1, dtype=torch.int32), torch.tensor([-1])), "indices\\[0\\] = -1"),
    ((torch.randn(2, 8), torch.zeros(3, 1, dtype=torch.int32), torch.tensor([0])), "bitmask must be int32 \\[2"),
    ((torch.randn(2, 8), torch.zeros(2, 1, dtype=torch.int64), torch.tensor([0])), "bitmask must be int32"),
    ((torch.randn(2, 8), torch.zeros(2, 1, dtype=torch.int32), torch.tensor([0], dtype=torch.int32)), "int64"),
    ((torch.randn(8, 2).T, torch.zeros(2, 1, dtype=torch.int32), torch.tensor([0])), "contiguous rows"),
    ((torch.zeros(2, 8, dtype=torch.int32), torch.zeros(2, 1, dtype=torch.int32), torch.tensor([0])), "floating"),
])
def test_bad_arguments_are_refused_and_nothing_is_written(args, match):
    logits = args[0]
    before = logits.clone()
    with pytest.raises(RuntimeError, match=match):
        minipaged_ops.apply_token_bitmask_(*args)
    assert torch.equal(logits, before)


def test_opcheck():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(3, 70, generator=g)
    bitmask = random_bitmask(3, 3, g)
    torch.library.opcheck(torch.ops.minipaged.apply_token_bitmask_, (logits, bitmask, torch.tensor([0, 2])))
