"""allocate_kv_cache: K/V pools in transparent huge pages on a Linux CPU."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import minipaged_ops
from minipaged_ops import reference
from conftest import nan_equal

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def huge_pages_kib() -> int:
    with open("/proc/self/smaps") as f:
        return sum(int(line.split()[1]) for line in f if line.startswith("AnonHugePages"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("num_blocks", [3, 512])  # 3 blocks: under one huge page, a plain tensor
def test_pool_is_a_usable_cache(num_blocks, dtype):
    shape = (num_blocks, 4, 16, 64)
    k, v = minipaged_ops.allocate_kv_cache(shape, dtype), minipaged_ops.allocate_kv_cache(shape, dtype)
    assert k.shape == shape and k.dtype == dtype and k.device.type == "cpu" and k.is_contiguous()
    assert k.data_ptr() != v.data_ptr()
    k.fill_(float("nan"))
    v.fill_(float("nan"))
    g = torch.Generator().manual_seed(num_blocks)
    tokens = 40
    key, value = (torch.randn(tokens, 4, 64, generator=g).to(dtype) for _ in range(2))
    slots = torch.randperm(num_blocks * 16 - 1, generator=g)[:tokens]
    slots[0] = num_blocks * 16 - 1  # the highest slot
    exp_k, exp_v = k.clone(), v.clone()
    minipaged_ops.reshape_and_cache(key, value, k, v, slots)
    reference.reshape_and_cache(key, value, exp_k, exp_v, slots)
    assert nan_equal(k, exp_k) and nan_equal(v, exp_v)


@pytest.mark.skipif(not sys.platform.startswith("linux") or not THP.exists() or "[madvise]" not in THP.read_text(),
                    reason="needs Linux with transparent huge pages in madvise mode (where only advised memory gets them)")
def test_large_pool_lies_in_huge_pages_only_when_asked():
    shape = (1024, 8, 16, 128)  # 64 MiB of float32
    before = huge_pages_kib()
    plain = minipaged_ops.allocate_kv_cache(shape, torch.float32, huge_pages=False).zero_()
    assert huge_pages_kib() - before < 4 << 10
    before = huge_pages_kib()
    pool = minipaged_ops.allocate_kv_cache(shape, torch.float32).zero_()
    # Most of it: the kernel may back a few pieces with small pages when memory is fragmented.
    assert huge_pages_kib() - before >= 32 << 10
    del plain, pool


def test_not_on_other_devices():
    meta = minipaged_ops.allocate_kv_cache((512, 4, 16, 64), torch.float32, device="meta")
    assert meta.device.type == "meta" and meta.shape == (512, 4, 16, 64)
