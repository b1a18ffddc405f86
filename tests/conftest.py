"""Shared fixtures and builders for the op tests."""

from __future__ import annotations

import getpass
import os
import tempfile

# TorchInductor's on-disk cache does not key its compiled C++ on ATEN_CPU_CAPABILITY: a kernel
# generated for one vector width and loaded under another stores past its buffer or computes the
# wrong thing (torch 2.14.1: heap corruption in test_compile_write_then_prefill_matches_eager after
# a run under ATEN_CPU_CAPABILITY=avx2, as bench/common.py's --isa sets). One cache per capability.
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(
    tempfile.gettempdir(), f"torchinductor_{getpass.getuser()}_{os.environ.get('ATEN_CPU_CAPABILITY', 'native')}"))

import pytest  # noqa: E402
import torch  # noqa: E402

import minipaged_ops  # noqa: F401  (loads the ops)
from minipaged_ops import emulation

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
# Tolerances against a float64 reference fed the same (already rounded) inputs: the output
# is rounded once to the query dtype, plus float32 accumulation error.
TOLERANCE = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}

# The shape grid of the attention op tests (decode and prefill).
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# (num_heads, num_kv_heads): GQA ratios 1, 2, 4, 8, 16 and odd ones (3, 5, 7: the CPU kernels
# split a group into sub-tiles of at most four heads, so these leave a ragged one).
HEADS = [(4, 4), (8, 4), (8, 2), (16, 2), (32, 2), (6, 2), (10, 2), (14, 2)]
HEAD_DIMS = [64, 128, 256]
BLOCK_SIZES = [8, 16, 32]


def nan_equal(a, b):
    """Equal, NaN included (a cache poisoned with NaN must keep it where nothing was written)."""
    return torch.equal(torch.nan_to_num(a.cpu().double(), nan=1e300), torch.nan_to_num(b.cpu().double(), nan=1e300))


def device_params(emu=True):
    """Every device, with CUDA marked so it skips cleanly without a GPU.

    "emu" runs the CUDA path (bindings and unchanged kernel source) on CPU tensors through the host
    emulation (minipaged_ops.emulation): tensors go to torch_device("emu") == "cpu" and the
    fixture below routes minipaged_ops' wrappers to torch.ops.minipaged_emu. `pytest -k emu`
    selects these cases.
    """
    cuda = pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device"))
    if not emu:
        return ["cpu", cuda]
    emu = pytest.param("emu", marks=pytest.mark.skipif(not emulation.available(),
                                                       reason=f"no CUDA emulation: {emulation.unavailable_reason()}"))
    return ["cpu", cuda, emu]


def torch_device(device):
    """The torch device of a test device: the emulated CUDA kernels run on CPU tensors."""
    return "cpu" if device == "emu" else device


@pytest.fixture(autouse=True)
def _dispatch_emulated_ops(request):
    """Route minipaged_ops' wrappers to the emulated CUDA kernels for the "emu" cases."""
    params = getattr(request.node, "callspec", None)
    if params is not None and params.params.get("device") == "emu":
        with emulation.dispatch():
            yield
    else:
        yield


def make_paged_case(seq_lens, num_heads, num_kv_heads, head_dim, block_size, dtype, device, *,
                    seed=0, sharp=False, spare_blocks=3):
    """Random caches with shuffled block tables that include the highest block id.

    Blocks not owned by any sequence and table entries past each sequence's length are
    poisoned (NaN data, out-of-range ids), so a kernel that reads them produces NaN or fails.
    """
    g = torch.Generator().manual_seed(seed)
    blocks_needed = [-(-n // block_size) for n in seq_lens]
    width = max(max(blocks_needed, default=0), 1) + 1
    num_blocks = sum(blocks_needed) + spare_blocks
    key_cache = torch.randn(num_blocks, num_kv_heads, block_size, head_dim, generator=g)
    value_cache = torch.randn(num_blocks, num_kv_heads, block_size, head_dim, generator=g)
    perm = torch.randperm(num_blocks, generator=g)
    # Hand the highest block id out first so it is always in use.
    perm = torch.cat([perm[perm == num_blocks - 1], perm[perm != num_blocks - 1]])
    block_tables = torch.full((len(seq_lens), width), -7, dtype=torch.int32)
    used = 0
    for s, n in enumerate(blocks_needed):
        block_tables[s, :n] = perm[used:used + n].to(torch.int32)
        block_tables[s, n:] = torch.tensor([num_blocks + 11, -1, 2**31 - 1], dtype=torch.int32).repeat(width)[: width - n]
        used += n
    for b in perm[used:]:
        key_cache[b] = float("nan")
        value_cache[b] = float("nan")
    # Slots past the end of a sequence inside its last block are unused too.
    for s, n in enumerate(seq_lens):
        if n % block_size:
            last = block_tables[s, n // block_size].item()
            key_cache[last, :, n % block_size:] = float("nan")
            value_cache[last, :, n % block_size:] = float("nan")
    query = torch.randn(len(seq_lens), num_heads, head_dim, generator=g)
    if sharp:
        # Make one cached key per sequence dominate its softmax: a near-one-hot distribution.
        for s, n in enumerate(seq_lens):
            if n:
                pos = int(torch.randint(n, (1,), generator=g))
                blk = block_tables[s, pos // block_size].item()
                kv = key_cache[blk, :, pos % block_size]
                query[s] = 0.3 * query[s] + 3.0 * kv.repeat_interleave(num_heads // num_kv_heads, 0)
    seq_lens_t = torch.tensor(seq_lens, dtype=torch.int32)
    device = torch_device(device)
    to = lambda t: t.to(device=device, dtype=dtype)
    return dict(query=to(query), key_cache=to(key_cache), value_cache=to(value_cache),
                block_tables=block_tables.to(device), seq_lens=seq_lens_t.to(device))


def make_prefill_case(seq_lens, query_lens, num_heads, num_kv_heads, head_dim, block_size, dtype, device, *,
                      seed=0):
    """make_paged_case plus packed new-token queries: sequence i's last query_lens[i] tokens are
    new (their K/V already in the cache), as paged_attention_prefill takes them."""
    assert all(0 <= q <= n for q, n in zip(query_lens, seq_lens, strict=True))
    case = make_paged_case(seq_lens, num_heads, num_kv_heads, head_dim, block_size, dtype, device, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    on = case["key_cache"].device  # where make_paged_case put the tensors
    case["query"] = torch.randn(sum(query_lens), num_heads, head_dim, generator=g).to(device=on, dtype=dtype)
    offsets = [0]
    for q in query_lens:
        offsets.append(offsets[-1] + q)
    case["cu_seqlens_q"] = torch.tensor(offsets, dtype=torch.int32, device=on)
    return case
