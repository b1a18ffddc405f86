"""paged_attention_prefill against the float64 reference: a grid of shapes and dtypes, ragged new
tokens over ragged histories, equality with decode, opcheck, compile, and bad input."""

from __future__ import annotations

import re
import zlib

import pytest
import torch

import minipaged_ops
from minipaged_ops import reference
from conftest import BLOCK_SIZES, DTYPES, HEAD_DIMS, HEADS, TOLERANCE, device_params, make_prefill_case, torch_device


def check(case, scale, dtype, max_query_len=None):
    out = minipaged_ops.paged_attention_prefill(**case, scale=scale, max_query_len=max_query_len)
    f64 = {k: (v.double().cpu() if v.is_floating_point() else v.cpu()) for k, v in case.items()}
    expected = reference.paged_attention_prefill(**f64, scale=scale)
    assert out.dtype == dtype and out.shape == case["query"].shape
    assert torch.isfinite(out).all(), "the kernel read poisoned (unused) cache memory or left a row unwritten"
    torch.testing.assert_close(out.double().cpu(), expected, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])
    return out


def ragged(block_size):
    """(seq_len, new tokens) pairs: empty; a fresh prompt of one token and of a few blocks plus a
    bit; history with no new tokens; decode-like; chunks that start mid-block and at a block
    boundary; a chunk longer than one CPU query tile."""
    b = block_size
    return [(0, 0), (1, 1), (2 * b + 5, 2 * b + 5), (3 * b + 5, 0), (3 * b + 1, 1), (2 * b + 3 + 20, 20),
            (4 * b, 2 * b), (77 + 70, 70)]


@pytest.mark.parametrize("device", device_params())
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"{h[0]}q{h[1]}kv")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_grid(dtype, heads, head_dim, block_size, device):
    pairs = ragged(block_size)
    seed = zlib.crc32(repr(("prefill", dtype, heads, head_dim, block_size)).encode())
    case = make_prefill_case([n for n, _ in pairs], [q for _, q in pairs], *heads, head_dim, block_size, dtype,
                             device, seed=seed)
    check(case, head_dim**-0.5, dtype)


@pytest.mark.parametrize("device", device_params())
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("block_size", [16, 64])  # 64: the engine's default on the CPU
def test_long_histories(dtype, block_size, device):
    # Thousands of cached tokens under short and long chunks, and a fresh prompt of several tiles.
    pairs = [(4097, 3), (5000, 300), (600, 600), (2049, 1)]
    case = make_prefill_case([n for n, _ in pairs], [q for _, q in pairs], 16, 8, 128, block_size, dtype, device,
                             seed=7)
    check(case, 128**-0.5, dtype)


# Query rows and head dims of the CPU lane path (query rows along the vector lanes: 16 a row group
# on AVX-512, 8 on AVX2; head_dim 64, 128 or 256) and of the generic tile path beside it (36: not
# a multiple of 8; 96: of 32, not 64): fresh prompts, chunks over history that start mid-block, a chunk
# shorter than a row group, and one past a 64-row tile; odd lengths throughout.
LANE_PAIRS = [(37, 37), (72, 19), (9, 3), (130, 65)]


@pytest.mark.parametrize("block_size", [1, 64])  # 16: the grids above
@pytest.mark.parametrize("head_dim", [36, 64, 96, 128, 256])
@pytest.mark.parametrize("group", range(1, 9))
def test_cpu_lane_grid(group, head_dim, block_size):
    # Under whichever CPU variant runs (make test-cpu-isas reruns it under each): GQA groups 1-8
    # (a row group then holds parts of several tokens, and its last lanes repeat the last row),
    # blocks of 1 (every chunk of keys copied) and 64, poisoned unused cache memory.
    for dtype in DTYPES:
        seed = zlib.crc32(repr(("lanes", dtype, group, head_dim, block_size)).encode())
        case = make_prefill_case([n for n, _ in LANE_PAIRS], [q for _, q in LANE_PAIRS], 2 * group, 2, head_dim,
                                 block_size, dtype, "cpu", seed=seed)
        check(case, head_dim**-0.5, dtype)


@pytest.mark.parametrize("device", device_params())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_few_tokens_over_a_long_history(dtype, device):
    # Few thread blocks for a long history: the CUDA kernel splits the history and merges.
    case = make_prefill_case([8000, 3], [2, 1], 8, 2, 128, 16, dtype, device, seed=17)
    check(case, 128**-0.5, dtype, max_query_len=2)


@pytest.mark.parametrize("device", device_params())
def test_max_query_len_hint(device):
    case = make_prefill_case([40, 9], [30, 9], 8, 4, 64, 16, torch.float32, device, seed=11)
    check(case, 0.125, torch.float32, max_query_len=30)
    check(case, 0.125, torch.float32, max_query_len=4096)
    if device == "cpu":  # the CPU checks data; CUDA only sizes its grid from the hint
        with pytest.raises(ValueError, match="max_query_len"):
            minipaged_ops.paged_attention_prefill(**case, scale=0.125, max_query_len=29)


@pytest.mark.parametrize("device", device_params())
def test_strided_query(device):
    case = make_prefill_case([40, 3], [12, 3], 8, 4, 64, 8, torch.float32, device, seed=5)
    fused = torch.randn(15, 8, 3 * 64, device=torch_device(device))
    fused[..., 64:128] = case["query"]
    case["query"] = fused[..., 64:128]  # a slice of a fused qkv projection
    assert not case["query"].is_contiguous()
    check(case, 0.125, torch.float32)


@pytest.mark.parametrize("device", device_params())
def test_no_new_tokens(device):
    case = make_prefill_case([20, 0], [0, 0], 4, 2, 64, 16, torch.float32, device)
    assert minipaged_ops.paged_attention_prefill(**case, scale=1.0).shape == (0, 4, 64)
    case = make_prefill_case([], [], 4, 2, 64, 16, torch.float32, device)
    assert minipaged_ops.paged_attention_prefill(**case, scale=1.0).shape == (0, 4, 64)


@pytest.mark.parametrize("device", device_params())
def test_batch_over_65535_sequences(device):
    # Sequences once sat on gridDim.y, which stops at 65,535 (the emulation checks the limit).
    # Mostly 0 or 1 new tokens, so that the emulated grid stays cheap.
    small = make_prefill_case([5, 0, 3, 9], [2, 0, 1, 3], 2, 1, 64, 8, torch.float32, device, seed=19)
    f64 = {k: (v.double().cpu() if v.is_floating_point() else v.cpu()) for k, v in small.items()}
    expected = reference.paged_attention_prefill(**f64, scale=0.125)
    pick = torch.tensor([0] + [2, 1] * 32_767 + [2, 3])  # 65,537 sequences
    cu = small["cu_seqlens_q"].cpu().long()
    q_lens = (cu[1:] - cu[:-1])[pick]
    # Query rows of the big batch: each picked sequence's rows of the small one, in order.
    rows = torch.repeat_interleave(cu[:-1][pick], q_lens) + torch.arange(int(q_lens.sum())) - torch.repeat_interleave(
        torch.cumsum(q_lens, 0) - q_lens, q_lens)
    on = small["query"].device
    case = dict(small, query=small["query"][rows.to(on)], block_tables=small["block_tables"][pick.to(on)],
                seq_lens=small["seq_lens"][pick.to(on)],
                cu_seqlens_q=torch.cat([torch.zeros(1, dtype=torch.long), torch.cumsum(q_lens, 0)]).to(on, torch.int32))
    # The hint sizes the CUDA grid (one query tile per sequence); without it, total_q would.
    out = minipaged_ops.paged_attention_prefill(**case, scale=0.125, max_query_len=3)
    torch.testing.assert_close(out.double().cpu(), expected[rows], atol=TOLERANCE[torch.float32],
                               rtol=TOLERANCE[torch.float32])


@pytest.mark.parametrize("device", device_params())
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("heads", [(16, 8), (12, 4), (32, 2)], ids=lambda h: f"{h[0]}q{h[1]}kv")
def test_one_new_token_each_equals_decode(heads, dtype, device):
    seq_lens = [1, 16, 33, 700, 5000]
    case = make_prefill_case(seq_lens, [1] * len(seq_lens), *heads, 128, 16, dtype, device, seed=13)
    prefill = minipaged_ops.paged_attention_prefill(**case, scale=0.09)
    decode = minipaged_ops.paged_attention_decode(case["query"], case["key_cache"], case["value_cache"],
                                                  case["block_tables"], case["seq_lens"], 0.09)
    # The two kernels split long contexts differently, so the float32 sums may round differently.
    torch.testing.assert_close(prefill, decode, atol=TOLERANCE[dtype] / 4, rtol=TOLERANCE[dtype] / 4)


def test_schema():
    assert str(torch.ops.minipaged.paged_attention_prefill.default._schema) == (
        "minipaged::paged_attention_prefill(Tensor query, Tensor key_cache, Tensor value_cache, "
        "Tensor block_tables, Tensor cu_seqlens_q, Tensor seq_lens, float scale, int? max_query_len=None, "
        "Tensor? key_scale=None, Tensor? value_scale=None) -> Tensor")


def prefill_args(case, scale=0.125):
    return (case["query"], case["key_cache"], case["value_cache"], case["block_tables"], case["cu_seqlens_q"],
            case["seq_lens"], scale)


@pytest.mark.parametrize("device", device_params())
def test_opcheck(device):
    case = make_prefill_case([0, 5, 33], [0, 5, 7], 8, 4, 64, 16, torch.float32, device, seed=4)
    torch.library.opcheck(torch.ops.minipaged.paged_attention_prefill.default, prefill_args(case))


@pytest.mark.parametrize("device", device_params())
def test_compile_write_then_prefill_matches_eager(device):
    torch._dynamo.reset()

    def step(query, key, value, key_cache, value_cache, slot_mapping, block_tables, cu_seqlens_q, seq_lens):
        minipaged_ops.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)
        return minipaged_ops.paged_attention_prefill(query, key_cache, value_cache, block_tables, cu_seqlens_q,
                                                     seq_lens, 0.125) * 2

    g = torch.Generator().manual_seed(0)
    device = torch_device(device)
    key_cache = torch.randn(8, 2, 16, 64, generator=g).to(device)
    value_cache = torch.randn(8, 2, 16, 64, generator=g).to(device)
    # Sequence 0: 18 cached + 3 new tokens (positions 18..20, block 3 offsets 2..4);
    # sequence 1: a fresh 2-token prompt in block 5.
    args = dict(
        query=torch.randn(5, 4, 64, generator=g).to(device),
        key=torch.randn(5, 2, 64, generator=g).to(device),
        value=torch.randn(5, 2, 64, generator=g).to(device),
        slot_mapping=torch.tensor([3 * 16 + 2, 3 * 16 + 3, 3 * 16 + 4, 5 * 16, 5 * 16 + 1], device=device),
        block_tables=torch.tensor([[1, 3], [5, 0]], dtype=torch.int32, device=device),
        cu_seqlens_q=torch.tensor([0, 3, 5], dtype=torch.int32, device=device),
        seq_lens=torch.tensor([21, 2], dtype=torch.int32, device=device),
    )
    eager_k, eager_v = key_cache.clone(), value_cache.clone()
    expected = step(key_cache=eager_k, value_cache=eager_v, **args)
    compiled = torch.compile(step, fullgraph=True)
    got = compiled(key_cache=key_cache, value_cache=value_cache, **args)
    torch.testing.assert_close(got, expected)
    assert torch.equal(key_cache, eager_k) and torch.equal(value_cache, eager_v), "in-place write lost under compile"
    f64 = {k: v.double().cpu() for k, v in (("query", args["query"]), ("key_cache", eager_k),
                                           ("value_cache", eager_v))}
    ref = reference.paged_attention_prefill(**f64, block_tables=args["block_tables"].cpu(),
                                            cu_seqlens_q=args["cu_seqlens_q"].cpu(),
                                            seq_lens=args["seq_lens"].cpu(), scale=0.125) * 2
    torch.testing.assert_close(got.double().cpu(), ref, atol=1e-4, rtol=1e-4)


def i32(values, like):
    return torch.tensor(values, dtype=torch.int32, device=like.device)


# (argument to replace, how, text the message must contain). The good input: 3 sequences of
# 16, 9 and 0 tokens with 4, 9 and 0 new ones (13 query rows) on a 6-block cache of 8-token blocks.
BAD = [
    ("query", lambda a: a["query"].half(), "query: expected dtype"),
    ("query", lambda a: a["query"][:, :3], "num_heads (3) must be a positive multiple of num_kv_heads (2)"),
    ("query", lambda a: a["query"][:, :, :32], "query: expected shape"),
    ("query", lambda a: a["query"][0], "query: expected shape"),
    ("value_cache", lambda a: a["value_cache"][:5], "value_cache: expected shape"),
    ("key_cache", lambda a: a["key_cache"].double(), "key_cache: expected dtype float32, float16 or bfloat16"),
    ("block_tables", lambda a: a["block_tables"].long(), "block_tables: expected dtype int32"),
    ("block_tables", lambda a: a["block_tables"][:2], "block_tables: expected shape"),
    ("block_tables", lambda a: i32([[5, 6], [0, 2], [3, 4]], a["query"]), "block_tables[0][1] = 6"),
    ("block_tables", lambda a: i32([[5, 1], [-3, 2], [3, 4]], a["query"]), "block_tables[1][0] = -3"),
    ("seq_lens", lambda a: a["seq_lens"].long(), "seq_lens: expected dtype int32"),
    ("seq_lens", lambda a: a["seq_lens"][:2], "block_tables: expected shape [2"),
    ("seq_lens", lambda a: i32([16, 17, 0], a["query"]), "seq_lens[1] = 17"),
    ("seq_lens", lambda a: i32([16, -1, 0], a["query"]), "seq_lens[1] = -1"),
    ("seq_lens", lambda a: i32([16, 8, 0], a["query"]), "sequence 1 has 9 new tokens but seq_lens[1] = 8"),
    ("cu_seqlens_q", lambda a: a["cu_seqlens_q"].long(), "cu_seqlens_q: expected dtype int32"),
    ("cu_seqlens_q", lambda a: a["cu_seqlens_q"][:3], "cu_seqlens_q: expected shape [4]"),
    ("cu_seqlens_q", lambda a: i32([1, 4, 13, 13], a["query"]), "cu_seqlens_q[0] = 0, got 1"),
    ("cu_seqlens_q", lambda a: i32([0, 10, 4, 13], a["query"]), "must not decrease, but cu_seqlens_q[2] = 4"),
    ("cu_seqlens_q", lambda a: i32([0, 4, 12, 12], a["query"]), "cu_seqlens_q[-1] = 13 (total_q"),
    ("cu_seqlens_q", lambda a: i32([0, 4, 13, 14], a["query"]), "sequence 2 has 1 new tokens but seq_lens[2] = 0"),
]


def good_prefill_inputs(device):
    device = torch_device(device)
    g = torch.Generator().manual_seed(0)
    kc = torch.randn(6, 2, 8, 64, generator=g).to(device)
    return dict(
        query=torch.randn(13, 4, 64, generator=g).to(device),
        key_cache=kc,
        value_cache=torch.randn(kc.shape, generator=g).to(device),
        block_tables=torch.tensor([[5, 1], [0, 2], [3, 4]], dtype=torch.int32, device=device),
        cu_seqlens_q=torch.tensor([0, 4, 13, 13], dtype=torch.int32, device=device),
        seq_lens=torch.tensor([16, 9, 0], dtype=torch.int32, device=device),
    )


@pytest.mark.parametrize("device", device_params())
@pytest.mark.parametrize("arg,bad,message", BAD, ids=[f"{b[0]}-{b[2][:40]}" for b in BAD])
def test_bad_input_is_rejected_before_any_write(arg, bad, message, device, monkeypatch):
    monkeypatch.setenv("MINIPAGED_VALIDATE", "1")  # the CUDA range checks are opt-in
    a = good_prefill_inputs(device)
    minipaged_ops.paged_attention_prefill(**a, scale=0.125)  # the unmodified inputs are accepted
    before = {k: a[k].clone() for k in ("key_cache", "value_cache")}
    a[arg] = bad(a)
    with pytest.raises((RuntimeError, ValueError), match=re.escape(message)):
        minipaged_ops.paged_attention_prefill(**a, scale=0.125)
    for name in ("key_cache", "value_cache"):
        if a[name].shape == before[name].shape and a[name].dtype == before[name].dtype:
            assert torch.equal(a[name], before[name]), f"{name} was changed although the input was rejected"


@pytest.mark.parametrize("device", [d for d in device_params() if d != "cpu"])
def test_cuda_out_of_range_data_stays_inside_the_cache(device, monkeypatch):
    """Without MINIPAGED_VALIDATE, bad indices on CUDA are clamped or skipped, never followed."""
    monkeypatch.delenv("MINIPAGED_VALIDATE", raising=False)
    a = good_prefill_inputs(device)
    a["block_tables"] = i32([[5, 99], [-4, 2], [3, 4]], a["query"])
    a["seq_lens"] = i32([1000, 3, -5], a["query"])
    a["cu_seqlens_q"] = i32([0, 7, 2, 400], a["query"])
    out = minipaged_ops.paged_attention_prefill(**a, scale=0.125)
    if device == "cuda":
        torch.cuda.synchronize()
    assert out.shape == a["query"].shape
