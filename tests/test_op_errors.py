"""Bad input raises a clear error naming the argument, before anything is written."""

from __future__ import annotations

import re

import pytest
import torch

import minipaged_ops
from conftest import device_params, torch_device

ERRORS = (RuntimeError, ValueError)


def good_inputs(device, dtype=torch.float32):
    device = torch_device(device)
    g = torch.Generator().manual_seed(0)
    kc = torch.randn(6, 2, 8, 64, generator=g).to(device=device, dtype=dtype)
    return dict(
        query=torch.randn(3, 4, 64, generator=g).to(device=device, dtype=dtype),
        key=torch.randn(5, 2, 64, generator=g).to(device=device, dtype=dtype),
        value=torch.randn(5, 2, 64, generator=g).to(device=device, dtype=dtype),
        key_cache=kc,
        value_cache=torch.randn(kc.shape, generator=g).to(device=device, dtype=dtype),
        slot_mapping=torch.tensor([0, 9, -1, 47, 20], device=device),
        block_tables=torch.tensor([[5, 1], [0, 2], [3, 4]], dtype=torch.int32, device=device),
        seq_lens=torch.tensor([16, 9, 0], dtype=torch.int32, device=device),
        block_mapping=torch.tensor([[0, 3], [1, 4]], device=device),
    )


def strided(t: torch.Tensor) -> torch.Tensor:
    """The same values as a non-contiguous view: every other element of a tensor twice as wide,
    the gaps holding 99 (out of range for every op here)."""
    wide = torch.full((*t.shape[:-1], 2 * t.shape[-1]), 99, dtype=t.dtype)
    wide[..., ::2] = t
    view = wide[..., ::2]
    assert not view.is_contiguous() and torch.equal(view, t)
    return view


def call_write(a):
    minipaged_ops.reshape_and_cache(a["key"], a["value"], a["key_cache"], a["value_cache"], a["slot_mapping"])


def call_decode(a):
    minipaged_ops.paged_attention_decode(a["query"], a["key_cache"], a["value_cache"], a["block_tables"],
                                         a["seq_lens"], 0.125)


def call_copy(a):
    minipaged_ops.copy_blocks(a["key_cache"], a["value_cache"], a["block_mapping"])


# (op, argument to replace, how to replace it, text the message must contain)
CASES = [
    # reshape_and_cache
    (call_write, "key", lambda a: a["key"].double(), "key: expected dtype"),
    (call_write, "value", lambda a: a["value"][:, :1], "value: expected shape"),
    (call_write, "key", lambda a: a["key"][:, :, :32], "key: expected shape"),
    (call_write, "slot_mapping", lambda a: a["slot_mapping"].float(), "slot_mapping: expected dtype"),
    (call_write, "slot_mapping", lambda a: a["slot_mapping"][:4], "slot_mapping: expected shape"),
    (call_write, "slot_mapping", lambda a: torch.tensor([0, 1, 2, 48, 3], device=a["key"].device), "slot_mapping: slot 48"),
    (call_write, "slot_mapping", lambda a: torch.tensor([0, 9, -1, 9, 20], device=a["key"].device), "slot 9 appears at indices 1 and 3"),
    (call_write, "key_cache", lambda a: a["key_cache"][:, :, :, :32], "key_cache"),
    (call_write, "value_cache", lambda a: a["value_cache"].half(), "value_cache: expected dtype"),
    (call_write, "key_cache", lambda a: a["key_cache"].transpose(0, 1).contiguous().transpose(0, 1), "key_cache: expected a contiguous"),
    (call_write, "key_cache", lambda a: a["key_cache"].double(), "key_cache: expected dtype float32, float16 or bfloat16"),
    # paged_attention_decode
    (call_decode, "query", lambda a: a["query"].half(), "query: expected dtype"),
    (call_decode, "query", lambda a: a["query"][:, :3], "num_heads (3) must be a positive multiple of num_kv_heads (2)"),
    (call_decode, "query", lambda a: a["query"][:, :, :32], "query: expected shape"),
    (call_decode, "block_tables", lambda a: a["block_tables"].long(), "block_tables: expected dtype int32"),
    (call_decode, "block_tables", lambda a: a["block_tables"].float(), "block_tables: expected dtype int32"),
    (call_decode, "block_tables", lambda a: a["block_tables"][:2], "block_tables: expected shape"),
    (call_decode, "seq_lens", lambda a: a["seq_lens"].long(), "seq_lens: expected dtype int32"),
    (call_decode, "seq_lens", lambda a: a["seq_lens"][:2], "seq_lens: expected shape"),
    (call_decode, "seq_lens", lambda a: torch.tensor([16, 17, 0], dtype=torch.int32, device=a["query"].device), "seq_lens[1] = 17"),
    (call_decode, "seq_lens", lambda a: torch.tensor([16, -1, 0], dtype=torch.int32, device=a["query"].device), "seq_lens[1] = -1"),
    (call_decode, "block_tables", lambda a: torch.tensor([[5, 6], [0, 2], [3, 4]], dtype=torch.int32, device=a["query"].device), "block_tables[0][1] = 6"),
    (call_decode, "block_tables", lambda a: torch.tensor([[5, 1], [-3, 2], [3, 4]], dtype=torch.int32, device=a["query"].device), "block_tables[1][0] = -3"),
    (call_decode, "value_cache", lambda a: a["value_cache"][:5], "value_cache: expected shape"),
    # index tensors are read through their strides: a bad entry of a strided view is found where it is
    (call_decode, "block_tables", lambda a: strided(torch.tensor([[5, 6], [0, 2], [3, 4]], dtype=torch.int32)).to(a["query"].device), "block_tables[0][1] = 6"),
    (call_write, "slot_mapping", lambda a: strided(torch.tensor([0, 9, -1, 9, 20])).to(a["key"].device), "slot 9 appears at indices 1 and 3"),
    (call_write, "slot_mapping", lambda a: torch.tensor([0, 1, 2, 48, 3], dtype=torch.int32, device=a["key"].device), "slot_mapping: slot 48"),
    (call_copy, "block_mapping", lambda a: strided(torch.tensor([[0, 6]])).to(a["key_cache"].device), "block_mapping: row 0 = (0, 6)"),
    # copy_blocks
    (call_copy, "block_mapping", lambda a: a["block_mapping"].int(), "block_mapping: expected dtype int64"),
    (call_copy, "block_mapping", lambda a: a["block_mapping"][:, :1], "block_mapping: expected shape"),
    (call_copy, "block_mapping", lambda a: torch.tensor([[0, 6]], device=a["key_cache"].device), "block_mapping: row 0 = (0, 6)"),
    (call_copy, "block_mapping", lambda a: torch.tensor([[0, 3], [1, 3]], device=a["key_cache"].device), "destination block 3 appears more than once"),
    (call_copy, "block_mapping", lambda a: torch.tensor([[0, 3], [3, 4]], device=a["key_cache"].device), "destination block 3 is also a source"),
]


@pytest.mark.parametrize("device", device_params())
@pytest.mark.parametrize("op,arg,bad,message", CASES, ids=[f"{c[0].__name__}-{c[3][:40]}" for c in CASES])
def test_bad_input_is_rejected_before_any_write(op, arg, bad, message, device, monkeypatch):
    monkeypatch.setenv("MINIPAGED_VALIDATE", "1")  # the CUDA range checks are opt-in
    a = good_inputs(device)
    op(dict(a))  # the unmodified inputs are accepted
    a = good_inputs(device)
    before = {k: a[k].clone() for k in ("key_cache", "value_cache")}
    a[arg] = bad(a)
    with pytest.raises(ERRORS, match=re.escape(message)):
        op(a)
    for name in ("key_cache", "value_cache"):
        if a[name].shape == before[name].shape and a[name].dtype == before[name].dtype:
            assert torch.equal(a[name], before[name]), f"{name} was written although the input was rejected"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("op", [call_write, call_decode, call_copy])
def test_device_mismatch(op):
    a = good_inputs("cuda")
    for name in ("query", "key", "slot_mapping", "block_tables", "block_mapping"):
        a[name] = a[name].cpu()
    with pytest.raises(ERRORS, match="expected a tensor on cuda"):
        op(a)


def test_strided_and_int32_indices_give_the_same_results():
    """The CPU ops read index tensors in place, through their strides and in either width: the
    same values laid out differently must give the same output and the same cache."""
    a = good_inputs("cpu")
    expected = minipaged_ops.paged_attention_decode(a["query"], a["key_cache"], a["value_cache"], a["block_tables"],
                                                    a["seq_lens"], 0.125, max_seq_len=16)
    got = minipaged_ops.paged_attention_decode(a["query"], a["key_cache"], a["value_cache"], strided(a["block_tables"]),
                                               strided(a["seq_lens"]), 0.125, max_seq_len=16)
    assert torch.equal(got, expected)
    written, copied = [], []
    for slots in (a["slot_mapping"], strided(a["slot_mapping"].int())):
        b = good_inputs("cpu")
        minipaged_ops.reshape_and_cache(b["key"], b["value"], b["key_cache"], b["value_cache"], slots)
        written.append((b["key_cache"], b["value_cache"]))
    for mapping in (a["block_mapping"], strided(a["block_mapping"])):
        b = good_inputs("cpu")
        minipaged_ops.copy_blocks(b["key_cache"], b["value_cache"], mapping)
        copied.append((b["key_cache"], b["value_cache"]))
    for (k0, v0), (k1, v1) in (written, copied):
        assert torch.equal(k0, k1) and torch.equal(v0, v1)
    with pytest.raises(ValueError, match="max_seq_len"):
        minipaged_ops.paged_attention_decode(a["query"], a["key_cache"], a["value_cache"], a["block_tables"],
                                             strided(a["seq_lens"]), 0.125, max_seq_len=15)


def test_max_seq_len_smaller_than_a_sequence():
    a = good_inputs("cpu")
    with pytest.raises(ValueError, match="max_seq_len"):
        minipaged_ops.paged_attention_decode(a["query"], a["key_cache"], a["value_cache"], a["block_tables"],
                                             a["seq_lens"], 0.125, max_seq_len=10)


@pytest.mark.parametrize("device", device_params()[1:])  # the CUDA path: on a GPU and emulated
def test_cuda_out_of_range_data_stays_inside_the_cache(device, monkeypatch):
    """Without MINIPAGED_VALIDATE, bad indices on CUDA are clamped or skipped, never followed."""
    monkeypatch.delenv("MINIPAGED_VALIDATE", raising=False)
    a = good_inputs(device)
    dev = torch_device(device)
    guard = torch.full((6, 2, 8, 64), 7.0, device=dev)
    a["block_tables"] = torch.tensor([[5, 99], [-4, 2], [3, 4]], dtype=torch.int32, device=dev)
    a["seq_lens"] = torch.tensor([1000, 9, -5], dtype=torch.int32, device=dev)
    out = minipaged_ops.paged_attention_decode(a["query"], a["key_cache"], a["value_cache"], a["block_tables"],
                                               a["seq_lens"], 0.125)
    assert torch.isfinite(out).all() and (out[2] == 0).all()
    a["slot_mapping"] = torch.tensor([0, 10**9, -1, 48, 20], device=dev)
    call_write(a)
    a["block_mapping"] = torch.tensor([[0, 600], [-1, 4]], device=dev)
    call_copy(a)
    if dev == "cuda":
        torch.cuda.synchronize()
    assert (guard == 7.0).all()
