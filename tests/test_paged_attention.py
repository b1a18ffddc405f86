"""paged_attention_decode against the float64 reference, over a grid of shapes and dtypes."""

from __future__ import annotations

import zlib

import pytest
import torch

import minipaged_ops
from minipaged_ops import reference
from conftest import BLOCK_SIZES, DTYPES, HEAD_DIMS, HEADS, TOLERANCE, device_params, make_paged_case, torch_device


def check(case, scale, dtype, max_seq_len=None):
    out = minipaged_ops.paged_attention_decode(**case, scale=scale, max_seq_len=max_seq_len)
    f64 = {k: (v.double().cpu() if v.is_floating_point() else v.cpu()) for k, v in case.items()}
    expected = reference.paged_attention_decode(**f64, scale=scale)
    assert out.dtype == dtype and out.shape == case["query"].shape
    assert torch.isfinite(out).all(), "the kernel read poisoned (unused) cache memory"
    torch.testing.assert_close(out.double().cpu(), expected, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])
    return out


@pytest.mark.parametrize("device", device_params())
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"{h[0]}q{h[1]}kv")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_grid(dtype, heads, head_dim, block_size, device):
    # Ragged lengths: empty, one token, exact block multiples, and one past a multiple.
    seq_lens = [0, 1, block_size, 3 * block_size, 3 * block_size + 1, 77]
    seed = zlib.crc32(repr((dtype, heads, head_dim, block_size)).encode())  # stable across runs
    case = make_paged_case(seq_lens, *heads, head_dim, block_size, dtype, device, seed=seed)
    out = check(case, head_dim**-0.5, dtype)
    assert (out[0] == 0).all(), "seq_len == 0 must give a zero row"


@pytest.mark.parametrize("device", device_params())
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_sharp_softmax(dtype, device):
    case = make_paged_case([5, 64, 300], 16, 4, 128, 16, dtype, device, seed=3, sharp=True)
    check(case, 1.0, dtype)


@pytest.mark.parametrize("device", device_params())
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("block_size", [16, 32, 64])  # 64: the engine's default on the CPU
def test_long_sequences(dtype, block_size, device):
    # Past 4,096 tokens: several partitions on both backends, merged.
    case = make_paged_case([4097, 9000, 33], 8, 2, 128, block_size, dtype, device, seed=7)
    check(case, 128**-0.5, dtype)


@pytest.mark.parametrize("device", device_params())
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("sharp", [False, True], ids=["random", "sharp"])
def test_many_heads_long_sequences(sharp, dtype, device):
    # 64 query heads and blocks of 32: the CPU kernel's work items (up to 512 tokens) then hold
    # several chunks of 128 tokens, whose softmax steps must rescale what came before.
    case = make_paged_case([2000, 1500, 1999, 1024, 700, 513, 1, 0], 64, 8, 64, 32, dtype, device, seed=23,
                           sharp=sharp)
    check(case, 64**-0.5, dtype)


@pytest.mark.parametrize("device", device_params())
def test_max_seq_len_hint(device):
    case = make_paged_case([100, 7, 64], 8, 4, 64, 16, torch.float32, device, seed=11)
    check(case, 0.125, torch.float32, max_seq_len=100)
    check(case, 0.125, torch.float32, max_seq_len=4096)


@pytest.mark.parametrize("device", device_params())
def test_strided_query(device):
    case = make_paged_case([40, 3], 8, 4, 64, 8, torch.float32, device, seed=5)
    fused = torch.randn(2, 8, 3 * 64, device=torch_device(device))
    fused[..., 64:128] = case["query"]
    case["query"] = fused[..., 64:128]  # a slice of a fused qkv projection
    assert not case["query"].is_contiguous()
    check(case, 0.125, torch.float32)


@pytest.mark.parametrize("device", device_params())
def test_empty_batch(device):
    case = make_paged_case([], 4, 4, 64, 16, torch.float32, device)
    out = minipaged_ops.paged_attention_decode(**case, scale=1.0)
    assert out.shape == (0, 4, 64)


@pytest.mark.parametrize("device", device_params())
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("head_dim", [40, 72, 80, 96])
@pytest.mark.parametrize("heads", [(4, 4), (8, 2), (12, 2)], ids=lambda h: f"{h[0]}q{h[1]}kv")
def test_cpu_head_dim_not_in_cuda_list(heads, head_dim, dtype, device):
    # The CPU kernel takes any head_dim (its fixed-size tiles cover 64, 128 and 256; these take
    # the general paths and their tails: not a multiple of 16, of 32, of the V panel width);
    # the CUDA kernel names the ones it supports.
    case = make_paged_case([20, 50, 3], *heads, head_dim, 16, dtype, device, seed=head_dim)
    if device == "cpu":
        check(case, head_dim**-0.5, dtype)
    else:
        with pytest.raises(ValueError, match="head_dim"):
            minipaged_ops.paged_attention_decode(**case, scale=1.0)


@pytest.mark.parametrize("block_size", [1, 64])  # 16: the grids above
@pytest.mark.parametrize("head_dim", [36, 64, 96, 128, 256])
@pytest.mark.parametrize("group", range(1, 9))
def test_cpu_tile_grid(group, head_dim, block_size):
    # The CPU decode's head tiles under whichever variant runs (make test-cpu-isas reruns it under
    # each): GQA groups 1-8 (query in registers, four-token tiles of up to 4 heads and the ragged
    # ones after them, P.V panels of 8, 4 or 2 vectors), head dims that are and are not multiples of
    # 8, 16, 32 and 64 (36, 96: the general paths and their element-by-element tails), blocks of
    # 1 and 64, odd lengths, poisoned unused memory.
    for dtype in DTYPES:
        seed = zlib.crc32(repr(("tiles", dtype, group, head_dim, block_size)).encode())
        case = make_paged_case([1, 7, 64, 131], 2 * group, 2, head_dim, block_size, dtype, "cpu", seed=seed)
        check(case, head_dim**-0.5, dtype)


@pytest.mark.parametrize("device", device_params())
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_all_scores_far_below_zero(dtype, device):
    # Every score near -160: a softmax whose running max started at 0 would underflow to all zeros.
    case = make_paged_case([1, 40, 300], 8, 2, 128, 16, torch.float32, "cpu", seed=13)
    case["key_cache"] = case["key_cache"] * 0.5 + 8.0
    case["value_cache"] = case["value_cache"] + 1.0
    case["query"] = -case["query"].abs() - 1.0
    case = {k: v.to(torch_device(device), dtype=dtype if v.is_floating_point() else v.dtype) for k, v in case.items()}
    check(case, 128**-0.5, dtype)


@pytest.mark.parametrize("device", device_params())
def test_several_chunks_per_cuda_block(device, monkeypatch):
    # Enough (sequence, kv head) pairs to fill two waves of a 132-SM GPU, so the CUDA kernel takes
    # no split-K and each thread block walks its sequence in several 256-token chunks of shared
    # scores. On emu under every schedule (EMU_SCHEDULE, src_cuda/emulation/runtime.cpp): in
    # `warp_ahead` and `random` one warp runs many shuffles (a whole barrier interval) ahead of the
    # others, so a barrier missing between two warps' uses of shared memory shows as a wrong result.
    g = torch.Generator().manual_seed(19)
    seq_lens = torch.randint(257, 800, (34,), generator=g).tolist()
    case = make_paged_case(seq_lens, 8, 8, 64, 16, torch.float32, device, seed=19)
    for schedule in ("lockstep", "random", "warp_ahead") if device == "emu" else ("",):
        monkeypatch.setenv("EMU_SCHEDULE", schedule)
        monkeypatch.setenv("EMU_SEED", "5")
        check(case, 0.125, torch.float32)


@pytest.mark.parametrize("device", device_params())
def test_bitwise_reproducible(device, monkeypatch):
    # Several partitions and a GQA tile of 8: the same input gives the same bits every run. On
    # emu each run takes another random thread order, which reorders any order-dependent sum.
    case = make_paged_case([700, 1, 4097], 16, 2, 128, 16, torch.float32, device, seed=17)
    outs = []
    for run in range(3):
        monkeypatch.setenv("EMU_SEED", str(run + 1))
        outs.append(minipaged_ops.paged_attention_decode(**case, scale=128**-0.5))
    assert all(torch.equal(outs[0], o) for o in outs[1:])


@pytest.mark.parametrize("device", device_params())
def test_max_seq_len_below_a_sequence(device, monkeypatch):
    # A max_seq_len that does not bound seq_lens is bad input: the CPU (which reads seq_lens)
    # rejects it, as does CUDA under MINIPAGED_VALIDATE=1; unchecked, CUDA attends to exactly the
    # first max_seq_len tokens (no more: the grid is sized from it).
    case = make_paged_case([100, 7, 64], 8, 4, 64, 16, torch.float32, device, seed=11)
    monkeypatch.setenv("MINIPAGED_VALIDATE", "1")
    with pytest.raises(ValueError, match=r"max_seq_len: 50 is smaller than the longest sequence in seq_lens \(100\)"):
        minipaged_ops.paged_attention_decode(**case, scale=0.125, max_seq_len=50)
    if device == "cpu":
        return
    monkeypatch.delenv("MINIPAGED_VALIDATE")
    for bound in (50, 0):
        clamped = dict(case, seq_lens=case["seq_lens"].clamp(max=bound))
        expected = minipaged_ops.paged_attention_decode(**clamped, scale=0.125)
        got = minipaged_ops.paged_attention_decode(**case, scale=0.125, max_seq_len=bound)
        torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-6)  # other partitions: last bits may differ


@pytest.mark.parametrize("device", device_params())
def test_batch_over_65535_sequences(device):
    # Sequences once sat on gridDim.y, which stops at 65,535.
    num_seqs = 65_537
    small = make_paged_case([5, 0, 3, 9], 1, 1, 64, 8, torch.float32, device, seed=19)
    pick = torch.tensor([0, 1, 2] + [1] * (num_seqs - 4) + [3])
    case = dict(small, query=small["query"][pick.to(small["query"].device)],
                block_tables=small["block_tables"][pick.to(small["query"].device)],
                seq_lens=small["seq_lens"][pick.to(small["query"].device)])
    out = minipaged_ops.paged_attention_decode(**case, scale=0.125)
    expected = minipaged_ops.paged_attention_decode(**small, scale=0.125)
    torch.testing.assert_close(out[[0, 1, 2, num_seqs - 1]], expected, atol=1e-6, rtol=1e-6)
    assert (out[3:num_seqs - 1] == 0).all()


@pytest.mark.parametrize("device", device_params())
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_score_spike_at_every_lane(dtype, device):
    # One key per sequence scores ~200 above the rest, at positions 0-31: whichever vector lane
    # (8 or 16 wide) and block it lands in, a softmax max that missed it would overflow exp.
    seq_lens = [40] * 32
    case = make_paged_case(seq_lens, 4, 2, 64, 16, torch.float32, "cpu", seed=5)
    query, key_cache, tables = case["query"], case["key_cache"], case["block_tables"]
    query[:, 1::2] = query[:, 0::2]  # both heads of a kv head ask the same
    for s in range(len(seq_lens)):
        block = tables[s, s // 16].item()
        key_cache[block, :, s % 16] = 25.0 * query[s, 0::2] / query[s, 0::2].norm(dim=-1, keepdim=True) * 8.0
    case = {k: (v.to(dtype) if v.is_floating_point() else v).to(torch_device(device)) for k, v in case.items()}
    check(case, 64**-0.5, dtype)
