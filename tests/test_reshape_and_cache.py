"""reshape_and_cache and copy_blocks against the reference."""

from __future__ import annotations

import pytest
import torch

import minipaged_ops
from minipaged_ops import reference
from conftest import device_params, nan_equal, torch_device

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.mark.parametrize("device", device_params())
@pytest.mark.parametrize("slot_dtype", [torch.int64, torch.int32], ids=str)
@pytest.mark.parametrize("block_size", [1, 8, 16, 32])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_writes_exactly_the_mapped_slots(dtype, block_size, slot_dtype, device):
    device = torch_device(device)
    g = torch.Generator().manual_seed(block_size)
    num_blocks, heads, dim, tokens = 9, 4, 64, 40
    num_slots = num_blocks * block_size
    poison = torch.full((num_blocks, heads, block_size, dim), float("nan"))
    key = torch.randn(tokens, heads, dim, generator=g)
    value = torch.randn(tokens, heads, dim, generator=g)
    slots = torch.randperm(num_slots, generator=g)[:tokens] if num_slots >= tokens else torch.arange(tokens) % num_slots
    slots = slots.clone()
    slots[::5] = -1  # padding tokens: skipped
    slots[1] = num_slots - 1  # the highest slot
    # A slot may appear once only (two writers to one slot would race on CUDA).
    seen, keep = set(), []
    for s in slots.tolist():
        keep.append(s if s < 0 or s not in seen else -1)
        seen.add(s)
    slots = torch.tensor(keep, dtype=slot_dtype)
    to = lambda t: t.to(device=device, dtype=dtype)
    key_cache, value_cache = to(poison), to(poison.clone())
    minipaged_ops.reshape_and_cache(to(key), to(value), key_cache, value_cache, slots.to(device))
    exp_k, exp_v = poison.clone().to(dtype), poison.clone().to(dtype)
    reference.reshape_and_cache(key.to(dtype), value.to(dtype), exp_k, exp_v, slots)
    assert nan_equal(key_cache, exp_k) and nan_equal(value_cache, exp_v)


@pytest.mark.parametrize("aligned", [True, False], ids=["aligned", "unaligned"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_large_write(dtype, aligned):
    # Past the CPU kernel's streaming-store limit (1 MiB of K and V written): 2,048 tokens x 4 x
    # 128 is 4 MiB in float32, 2 MiB in 16-bit dtypes. A cache view one element into its storage
    # is not 64-byte aligned, which the streaming path must notice (and fall back to plain copies).
    g = torch.Generator().manual_seed(7)
    tokens, heads, dim, block_size = 2048, 4, 128, 16
    num_blocks = tokens // block_size + 3
    shape = (num_blocks, heads, block_size, dim)
    numel = num_blocks * heads * block_size * dim
    key = torch.randn(tokens, heads, dim, generator=g).to(dtype)
    value = torch.randn(tokens, heads, dim, generator=g).to(dtype)
    highest = num_blocks * block_size - 1
    slots = torch.randperm(highest, generator=g)[:tokens]  # distinct, the highest slot left out
    slots[3] = highest
    slots[::7] = -1  # padding tokens: skipped
    offset = 0 if aligned else 1
    caches = [torch.full((numel + 1,), float("nan"), dtype=dtype)[offset:offset + numel].view(shape) for _ in range(2)]
    assert (caches[0].data_ptr() % 64 == 0) == aligned
    expected = [c.clone() for c in caches]
    minipaged_ops.reshape_and_cache(key, value, caches[0], caches[1], slots)
    reference.reshape_and_cache(key, value, expected[0], expected[1], slots)
    assert nan_equal(caches[0], expected[0]) and nan_equal(caches[1], expected[1])


@pytest.mark.parametrize("device", device_params())
def test_strided_key_value(device):
    device = torch_device(device)
    # key and value as slices of a fused qkv projection output, and a transposed view.
    tokens, heads, dim = 13, 2, 64
    qkv = torch.randn(tokens, 3 * heads, dim, device=device)
    key, value = qkv[:, heads:2 * heads], qkv[:, 2 * heads:]
    value_t = value.transpose(1, 2).contiguous().transpose(1, 2)  # stride(2) != 1
    assert not key.is_contiguous() and value_t.stride(2) != 1
    key_cache = torch.zeros(4, heads, 8, dim, device=device)
    value_cache = torch.zeros_like(key_cache)
    slots = torch.arange(3, 3 + tokens, device=device)
    minipaged_ops.reshape_and_cache(key, value_t, key_cache, value_cache, slots)
    exp_k, exp_v = torch.zeros_like(key_cache).cpu(), torch.zeros_like(value_cache).cpu()
    reference.reshape_and_cache(key.cpu(), value.cpu(), exp_k, exp_v, slots.cpu())
    assert torch.equal(key_cache.cpu(), exp_k) and torch.equal(value_cache.cpu(), exp_v)


@pytest.mark.parametrize("device", device_params())
def test_zero_tokens(device):
    device = torch_device(device)
    key_cache = torch.zeros(2, 1, 4, 64, device=device)
    value_cache = torch.zeros_like(key_cache)
    empty = torch.empty(0, 1, 64, device=device)
    minipaged_ops.reshape_and_cache(empty, empty, key_cache, value_cache, torch.empty(0, dtype=torch.long, device=device))
    assert (key_cache == 0).all()


@pytest.mark.parametrize("device", device_params())
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_copy_blocks(dtype, device):
    device = torch_device(device)
    g = torch.Generator().manual_seed(1)
    key_cache = torch.randn(10, 2, 16, 64, generator=g).to(device=device, dtype=dtype)
    value_cache = torch.randn(10, 2, 16, 64, generator=g).to(device=device, dtype=dtype)
    mapping = torch.tensor([[0, 9], [3, 4], [3, 5], [8, 1]], dtype=torch.int64)
    exp_k, exp_v = key_cache.cpu().clone(), value_cache.cpu().clone()
    reference.copy_blocks(exp_k, exp_v, mapping)
    minipaged_ops.copy_blocks(key_cache, value_cache, mapping.to(device))
    assert torch.equal(key_cache.cpu(), exp_k) and torch.equal(value_cache.cpu(), exp_v)
    minipaged_ops.copy_blocks(key_cache, value_cache, torch.empty(0, 2, dtype=torch.int64, device=device))
    assert torch.equal(key_cache.cpu(), exp_k)
