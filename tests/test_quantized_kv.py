"""8-bit KV caches at the op level: int8 (a scale per token and kv head) and fp8 e4m3 / e5m2 (a
scale per layer), written by reshape_and_cache, read by decode and prefill, copied by copy_blocks.

The quantized bytes and scales must equal the reference's exactly (both quantize in float32); the
attention ops are checked against the float64 reference on the dequantized K/V with the query
dtype's tolerance (the format's own error is what the round-trip tests bound, from the format's
mantissa bits). Unused cache memory is poisoned: int8 scales and e5m2 bytes with NaN, e4m3 bytes
(whose NaN reads as 480 in the kernels' fast conversion) with the largest value.
"""

from __future__ import annotations

import re
import zlib

import pytest
import torch

import minipaged_ops
from minipaged_ops import reference
from minipaged_ops.quantized import FORMAT_MAX, layer_scale_for, new_scales
from conftest import TOLERANCE, device_params, nan_equal, torch_device

FORMATS = [torch.int8, torch.float8_e4m3fn, torch.float8_e5m2]
FORMAT_IDS = ["int8", "e4m3", "e5m2"]
QUERY_DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# Mantissa bits and the smallest normal exponent of the fp8 formats: the round-trip error bounds.
FP8_MANTISSA = {torch.float8_e4m3fn: 3, torch.float8_e5m2: 2}
FP8_MIN_NORMAL_EXP = {torch.float8_e4m3fn: -6, torch.float8_e5m2: -14}
POISON_BYTE = {torch.int8: 0x7f, torch.float8_e4m3fn: 0x7e, torch.float8_e5m2: 0x7f}


def poisoned_pool(fmt, num_blocks, num_kv_heads, block_size, head_dim, device, *, key_layer=0.03, value_layer=0.02):
    """Caches and scales of `fmt`, every byte poisoned; fp8 layer scales set (to a batch's range)."""
    shape = (num_blocks, num_kv_heads, block_size, head_dim)
    caches = [torch.full(shape, POISON_BYTE[fmt], dtype=torch.uint8, device=device).view(fmt) for _ in range(2)]
    key_scale, value_scale = new_scales(fmt, num_blocks, num_kv_heads, block_size, device)
    if fmt == torch.int8:
        key_scale.fill_(float("nan"))
        value_scale.fill_(float("nan"))
    else:
        key_scale.fill_(key_layer)
        value_scale.fill_(value_layer)
    return caches[0], caches[1], key_scale, value_scale


def same_bits(a, b):
    """Bytes equal (fp8 NaN included) and scales equal (NaN included)."""
    if a.dtype == torch.float32:
        return nan_equal(a, b)
    return torch.equal(a.cpu().view(torch.uint8), b.cpu().view(torch.uint8))


def make_case(fmt, seq_lens, num_heads, num_kv_heads, head_dim, block_size, query_dtype, device, *, seed=0,
              spare_blocks=2, query_rows=None):
    """Writes every token of `seq_lens` (shuffled blocks, the highest id in use, pad tokens with slot
    -1 between them) with the op, checks the bytes and scales against the reference's write, and
    returns the decode inputs with `query_rows` queries (default: one per sequence)."""
    g = torch.Generator().manual_seed(seed)
    dev = torch_device(device)
    blocks_needed = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_needed) + spare_blocks
    width = max(max(blocks_needed, default=0), 1) + 1
    perm = torch.randperm(num_blocks, generator=g)
    perm = torch.cat([perm[perm == num_blocks - 1], perm[perm != num_blocks - 1]])
    block_tables = torch.full((len(seq_lens), width), -7, dtype=torch.int32)
    slots, used = [], 0
    for s, n in enumerate(seq_lens):
        block_tables[s, :blocks_needed[s]] = perm[used:used + blocks_needed[s]].to(torch.int32)
        used += blocks_needed[s]
        slots += [int(block_tables[s, p // block_size]) * block_size + p % block_size for p in range(n)]
        slots.append(-1)  # a pad token between sequences
    num_tokens = len(slots)
    # K/V of a real model's spread: most values small, a few outliers per row.
    key = torch.randn(num_tokens, num_kv_heads, head_dim, generator=g)
    value = torch.randn(num_tokens, num_kv_heads, head_dim, generator=g) * 0.7
    key[:, :, 3] *= 6.0
    value[:, :, 5] *= 4.0
    key, value = key.to(query_dtype), value.to(query_dtype)
    slot_mapping = torch.tensor(slots, dtype=torch.int64)
    # fp8 layer scales from this batch's maximum, as calculate_kv_scales sets them.
    layer = dict(key_layer=float(layer_scale_for(key, fmt)), value_layer=float(layer_scale_for(value, fmt))) \
        if fmt != torch.int8 else {}
    key_cache, value_cache, key_scale, value_scale = poisoned_pool(fmt, num_blocks, num_kv_heads, block_size, head_dim,
                                                                   dev, **layer)
    expected = [t.cpu().clone() for t in (key_cache, value_cache, key_scale, value_scale)]
    minipaged_ops.reshape_and_cache(key.to(dev), value.to(dev), key_cache, value_cache, slot_mapping.to(dev),
                                    key_scale, value_scale)
    reference.reshape_and_cache(key, value, expected[0], expected[1], slot_mapping, *expected[2:])
    for got, want, name in zip((key_cache, value_cache, key_scale, value_scale), expected,
                               ("key_cache", "value_cache", "key_scale", "value_scale"), strict=True):
        assert same_bits(got, want), f"{name} differs from the reference's write"
    rows = len(seq_lens) if query_rows is None else query_rows
    query = torch.randn(rows, num_heads, head_dim, generator=g).to(device=dev, dtype=query_dtype)
    return dict(query=query, key_cache=key_cache, value_cache=value_cache, block_tables=block_tables.to(dev),
                seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev), key_scale=key_scale,
                value_scale=value_scale)


def on_cpu_f64(case):
    """The case as the reference takes it: the query in float64, the 8-bit caches as they are."""
    return {k: (v.double().cpu() if k == "query" else v.cpu()) for k, v in case.items()}


def check_decode(case, scale, query_dtype):
    out = minipaged_ops.paged_attention_decode(**case, scale=scale)
    expected = reference.paged_attention_decode(**on_cpu_f64(case), scale=scale)
    assert out.dtype == query_dtype and out.shape == case["query"].shape
    assert torch.isfinite(out).all(), "the kernel read poisoned (unused) cache memory"
    tol = TOLERANCE[query_dtype]
    torch.testing.assert_close(out.double().cpu(), expected, atol=tol, rtol=tol)
    return out


def check_prefill(case, scale, query_dtype):
    out = minipaged_ops.paged_attention_prefill(**case, scale=scale)
    expected = reference.paged_attention_prefill(**on_cpu_f64(case), scale=scale)
    assert out.dtype == query_dtype and out.shape == case["query"].shape
    assert torch.isfinite(out).all(), "the kernel read poisoned (unused) cache memory"
    tol = TOLERANCE[query_dtype]
    torch.testing.assert_close(out.double().cpu(), expected, atol=tol, rtol=tol)
    return out


def seed_of(*parts):
    return zlib.crc32(repr(parts).encode())


# ---- the write: bytes, scales, error bounds, saturation

@pytest.mark.parametrize("device", device_params())
@pytest.mark.parametrize("input_dtype", QUERY_DTYPES, ids=str)
@pytest.mark.parametrize("fmt", FORMATS, ids=FORMAT_IDS)
def test_write_matches_reference_and_skips_pads(fmt, input_dtype, device):
    # make_case compares every byte and scale with the reference's write; poison stays where no
    # token was written (pad slots, the spare blocks, the tails of last blocks).
    case = make_case(fmt, [1, 16, 37, 0, 5], 8, 4, 64, 16, input_dtype, device, seed=seed_of(fmt, input_dtype))
    key_cache = case["key_cache"].cpu()
    written = torch.zeros(key_cache.shape[:3], dtype=torch.bool)
    for s, n in enumerate(case["seq_lens"].tolist()):
        for p in range(n):
            written[int(case["block_tables"][s, p // 16]), :, p % 16] = True
    untouched = key_cache.view(torch.uint8)[~written]
    assert (untouched == POISON_BYTE[fmt]).all()
    if fmt == torch.int8:
        assert torch.isnan(case["key_scale"].cpu()[~written]).all()
        assert (case["key_scale"].cpu()[written] > 0).all()


@pytest.mark.parametrize("device", device_params())
def test_strided_key_value(device):
    # key and value as slices of a fused qkv projection, one with a strided head_dim.
    dev = torch_device(device)
    g = torch.Generator().manual_seed(2)
    qkv = torch.randn(9, 6, 64, generator=g).to(dev)
    key, value = qkv[:, 2:4], qkv[:, 4:6].transpose(1, 2).contiguous().transpose(1, 2)
    assert key.stride(2) == 1 and value.stride(2) != 1
    slots = torch.arange(9, device=dev) * 3
    for fmt in FORMATS:
        key_cache, value_cache, ks, vs = poisoned_pool(fmt, 4, 2, 8, 64, dev)
        expected = [t.cpu().clone() for t in (key_cache, value_cache, ks, vs)]
        minipaged_ops.reshape_and_cache(key, value, key_cache, value_cache, slots, ks, vs)
        reference.reshape_and_cache(key.cpu(), value.cpu(), expected[0], expected[1], slots.cpu(), *expected[2:])
        for got, want in zip((key_cache, value_cache, ks, vs), expected, strict=True):
            assert same_bits(got, want)


def round_trip(fmt, x, scale=None):
    q, s = reference.quantize(x, fmt, scale)
    return reference.dequantize(q, s), s


@pytest.mark.parametrize("fmt", FORMATS, ids=FORMAT_IDS)
def test_round_trip_error_bound(fmt):
    # Bounds from the format: int8 rounds to the nearest multiple of its scale (error <= scale / 2);
    # fp8 keeps MANT mantissa bits (relative error <= 2^-(MANT + 1)) down to its smallest normal,
    # below which steps are 2^(min_exp - MANT) (absolute error <= half of that), times the scale.
    # Each bound must also be approached (within a factor of 2): a looser rounding would pass a
    # test that only checked an upper bound far above it.
    g = torch.Generator().manual_seed(5)
    x = torch.randn(64, 4, 128, generator=g) * torch.logspace(-4, 1, 128)  # six decades per row
    if fmt == torch.int8:
        back, scale = round_trip(fmt, x)
        bound = scale.double()[..., None] / 2 * (1 + 1e-6)
    else:
        scale = layer_scale_for(x, fmt)  # the batch's maximum onto the format's: nothing saturates
        back, _ = round_trip(fmt, x, scale)
        mant, min_exp = FP8_MANTISSA[fmt], FP8_MIN_NORMAL_EXP[fmt]
        relative = x.double().abs() * 2.0 ** -(mant + 1)
        absolute = torch.full_like(relative, 2.0 ** (min_exp - mant - 1) * float(scale))
        bound = torch.maximum(relative, absolute) * (1 + 1e-6)
    err = (back - x.double()).abs()
    assert (err <= bound).all(), f"round-trip error {float((err / bound).max()):.3f} x the format's bound"
    assert float((err / bound).max()) > 0.5, "the bound is never approached: is the format rounding at all?"


@pytest.mark.parametrize("device", device_params())
@pytest.mark.parametrize("fmt", FORMATS[1:], ids=FORMAT_IDS[1:])
def test_fp8_saturates(fmt, device):
    # Values past the format's range times the scale store the largest value, with their sign
    # (torch's own conversion would give NaN for e4m3 and inf for e5m2); inf too.
    dev = torch_device(device)
    limit = FORMAT_MAX[fmt]
    key_cache, value_cache, ks, vs = poisoned_pool(fmt, 2, 1, 4, 64, dev, key_layer=0.5, value_layer=2.0)
    key = torch.full((3, 1, 64), 0.25, device=dev)
    key[0, 0, :8] = torch.tensor([1e30, -1e30, float("inf"), float("-inf"), limit * 0.5, -limit * 0.5,
                                  limit * 0.5 * 1.01, limit * 0.5 * 0.9])
    value = -key * 3
    minipaged_ops.reshape_and_cache(key, value, key_cache, value_cache, torch.tensor([0, 5, -1], device=dev), ks, vs)
    k = reference.dequantize(key_cache, ks).cpu()[0, 0, 0]
    v = reference.dequantize(value_cache, vs).cpu()[0, 0, 0]
    top = limit * 0.5
    assert k[:4].tolist() == [top, -top, top, -top] and k[4:7].tolist() == [top, -top, top]
    assert abs(float(k[7]) - limit * 0.5 * 0.9) <= limit * 0.5 * 0.9 * 2.0 ** -(FP8_MANTISSA[fmt] + 1)
    vtop = limit * 2.0
    assert v[:4].tolist() == [-vtop, vtop, -vtop, vtop]


def test_int8_scale_maps_each_row_onto_127():
    g = torch.Generator().manual_seed(9)
    x = torch.randn(10, 3, 96, generator=g) * torch.rand(10, 3, 1, generator=g) * 50
    x[4, 1] = 0  # an all-zero row: zeros with scale 0
    q, scale = reference.quantize(x, torch.int8)
    key_cache, value_cache, ks, vs = poisoned_pool(torch.int8, 3, 3, 4, 96, "cpu")
    minipaged_ops.reshape_and_cache(x, x, key_cache, value_cache, torch.arange(10), ks, vs)
    assert torch.equal(key_cache.flatten(0, 2)[[s // 4 * 12 + h * 4 + s % 4 for s in range(10) for h in range(3)]],
                       q.flatten(0, 1))
    amax_codes = q.abs().amax(-1)
    assert (amax_codes[x.abs().amax(-1) > 0] == 127).all() and q[4, 1].eq(0).all() and scale[4, 1] == 0


# ---- decode and prefill against the reference on the dequantized K/V

@pytest.mark.parametrize("device", device_params())
@pytest.mark.parametrize("block_size", [8, 16])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("heads", [(8, 2), (16, 8), (6, 2)], ids=lambda h: f"{h[0]}q{h[1]}kv")
@pytest.mark.parametrize("query_dtype", QUERY_DTYPES, ids=str)
@pytest.mark.parametrize("fmt", FORMATS, ids=FORMAT_IDS)
def test_decode_grid(fmt, query_dtype, heads, head_dim, block_size, device):
    seq_lens = [0, 1, block_size, 3 * block_size + 1, 77]
    case = make_case(fmt, seq_lens, *heads, head_dim, block_size, query_dtype, device,
                     seed=seed_of("decode", fmt, query_dtype, heads, head_dim, block_size))
    out = check_decode(case, head_dim**-0.5, query_dtype)
    assert (out[0] == 0).all(), "seq_len == 0 must give a zero row"


@pytest.mark.parametrize("block_size", [1, 16, 64])
@pytest.mark.parametrize("head_dim", [36, 64, 96, 128, 256])
@pytest.mark.parametrize("group", range(1, 9))
def test_cpu_tile_grid(group, head_dim, block_size):
    # The CPU decode's 8-bit paths under whichever variant runs (make test-cpu-isas reruns it under
    # each): int8 under a 16-bit query takes the 16-bit integer pair tiles (AVX512-VNNI and AVX2: Q.K
    # four tokens at a time and the one-token tail, P.V two tokens per pair with an odd one left)
    # where the head dim is a multiple of 32 and, on AVX2, the group at most 4, and the float tiles
    # elsewhere; fp8 the bfloat16-pair or float tiles. GQA groups 1-8, head dims that are and are
    # not multiples of 16 and 32, blocks of 1, 16 and 64, odd lengths, poisoned unused memory.
    for fmt in FORMATS:
        for query_dtype in (torch.bfloat16, torch.float32):
            seed = seed_of("tiles", fmt, query_dtype, group, head_dim, block_size)
            case = make_case(fmt, [1, 7, 64, 131], 2 * group, 2, head_dim, block_size, query_dtype, "cpu", seed=seed)
            check_decode(case, head_dim**-0.5, query_dtype)


@pytest.mark.parametrize("device", device_params())
@pytest.mark.parametrize("fmt", FORMATS, ids=FORMAT_IDS)
def test_decode_long_sequences(fmt, device):
    # Several partitions (and on the CPU several chunks per work item with 64 heads) merged.
    case = make_case(fmt, [4097, 1500, 3], 16, 2, 128, 16, torch.bfloat16, device, seed=seed_of("long", fmt))
    check_decode(case, 128**-0.5, torch.bfloat16)
    case = make_case(fmt, [2000, 700, 1], 64, 8, 64, 32, torch.float32, device, seed=seed_of("wide", fmt))
    check_decode(case, 64**-0.5, torch.float32)
    # Blocks of 64, the engine's default on the CPU: ragged ends inside a block, several partitions.
    case = make_case(fmt, [4160 + 37, 64, 129], 16, 8, 128, 64, torch.bfloat16, device, seed=seed_of("b64", fmt))
    check_decode(case, 128**-0.5, torch.bfloat16)


def fp8_codes(fmt, subnormal_only):
    """Every finite code of an fp8 format (both signs), or only its zeros and subnormals."""
    codes = torch.arange(256, dtype=torch.int32)
    exponent = (codes & 0x7f) >> (3 if fmt == torch.float8_e4m3fn else 2)
    finite = (codes & 0x7f) != 0x7f if fmt == torch.float8_e4m3fn else exponent != 31
    return codes[exponent == 0] if subnormal_only else codes[finite]


def fp8_code_case(fmt, subnormal_only, query_dtype, device, seed, key_layer=None):
    """A decode case on fp8 bytes written directly: every finite code, or only subnormals with layer
    scales that make them O(1) (or the given K layer scale)."""
    g = torch.Generator().manual_seed(seed)
    num_kv_heads, head_dim, block_size, seq_lens = 2, 128, 16, [200, 37]
    blocks = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks) + 1  # one spare
    codes = fp8_codes(fmt, subnormal_only)
    shape = (num_blocks, num_kv_heads, block_size, head_dim)
    key_cache, value_cache = (codes[torch.randint(len(codes), shape, generator=g)].to(torch.uint8).view(fmt)
                              for _ in range(2))
    largest = 7 * 2.0**-9 if fmt == torch.float8_e4m3fn else 3 * 2.0**-16  # subnormal
    layer = 1.0 / largest if subnormal_only else 1.0 / FORMAT_MAX[fmt]
    key_scale, value_scale = torch.full((1,), key_layer or 2 * layer), torch.full((1,), layer)
    perm = torch.randperm(num_blocks, generator=g).to(torch.int32)
    block_tables = torch.full((len(seq_lens), max(blocks)), -7, dtype=torch.int32)
    block_tables[0, :blocks[0]], block_tables[1, :blocks[1]] = perm[:blocks[0]], perm[blocks[0]:sum(blocks)]
    query = torch.randn(len(seq_lens), 8, head_dim, generator=g).to(query_dtype)
    dev = torch_device(device)
    return dict(query=query.to(dev), key_cache=key_cache.to(dev), value_cache=value_cache.to(dev),
                block_tables=block_tables.to(dev), seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
                key_scale=key_scale.to(dev), value_scale=value_scale.to(dev))


@pytest.mark.parametrize("device", device_params())
@pytest.mark.parametrize("query_dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("subnormal_only", [True, False], ids=["subnormals", "all-codes"])
@pytest.mark.parametrize("fmt", FORMATS[1:], ids=FORMAT_IDS[1:])
def test_decode_reads_every_fp8_code_exactly(fmt, subnormal_only, query_dtype, device):
    # The kernels' fp8 conversions (the CPU's bfloat16 path rebuilds subnormals from a table, since
    # the pair dot product reads bfloat16 subnormals as zero; AVX2's pair order makes them float32
    # subnormals) against the reference.
    case = fp8_code_case(fmt, subnormal_only, query_dtype, device, seed_of("codes", fmt, subnormal_only))
    out = check_decode(case, 128**-0.5, query_dtype)
    assert out.abs().amax() > 0.05, "outputs too small to tell a lost subnormal"


@pytest.mark.parametrize("fmt", FORMATS[1:], ids=FORMAT_IDS[1:])
def test_cpu_fp8_decode_with_denormals_flushed(fmt):
    # torch.set_flush_denormal(True) sets MXCSR's DAZ, which reads float32 subnormals as zero: AVX2's
    # fp8 pair order (whose subnormals are float32 subnormals) must not be taken then.
    case = fp8_code_case(fmt, True, torch.float32, "cpu", seed_of("daz", fmt))
    assert torch.set_flush_denormal(True), "this CPU cannot flush denormals"
    try:
        out = check_decode(case, 128**-0.5, torch.float32)
    finally:
        torch.set_flush_denormal(False)
    assert out.abs().amax() > 0.05, "outputs too small to tell a lost subnormal"


@pytest.mark.parametrize("fmt", FORMATS[1:], ids=FORMAT_IDS[1:])
def test_cpu_fp8_decode_with_a_query_past_the_pair_order_range(fmt):
    # A K layer scale so large that the query it is folded into (scale * K layer scale, x256 for
    # e4m3's raw elements) reaches 2^16-2^18 while the scores stay O(10) on subnormal K bytes: AVX2's
    # pair order, which multiplies that query by 2^112, would overflow it; the kernel must take the
    # float16 route there.
    raw = 256 if fmt == torch.float8_e4m3fn else 1
    case = fp8_code_case(fmt, True, torch.float32, "cpu", seed_of("huge", fmt),
                         key_layer=2.0**16 / (128**-0.5 * raw))
    out = check_decode(case, 128**-0.5, torch.float32)
    assert out.abs().amax() > 0.05


@pytest.mark.parametrize("device", device_params())
@pytest.mark.parametrize("query_dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("fmt", FORMATS[1:], ids=FORMAT_IDS[1:])
def test_one_token_decode_returns_every_fp8_code_bit_exact(fmt, query_dtype, device):
    # A sequence of one token attends to it with weight 1, so the output is its V row times the
    # layer scale: with a power-of-two scale, every fp8 code's value exactly (a tolerance would let a
    # conversion off by one bfloat16 unit in a single code pass).
    codes = fp8_codes(fmt, subnormal_only=False)
    num_seqs, num_kv_heads, head_dim, block_size = 2, 2, 128, 16
    rows = num_seqs * num_kv_heads
    assert rows * head_dim >= len(codes)
    value_bytes = codes[torch.arange(rows * head_dim) % len(codes)].reshape(num_seqs, num_kv_heads, head_dim)
    value_cache = torch.zeros(num_seqs + 1, num_kv_heads, block_size, head_dim, dtype=torch.uint8)
    value_cache[torch.arange(num_seqs) + 1, :, 0] = value_bytes.to(torch.uint8)  # block 0 unused
    value_cache = value_cache.view(fmt)
    key_cache = torch.zeros_like(value_cache)
    value_scale = 2.0**-3
    query = torch.randn(num_seqs, num_kv_heads * 4, head_dim, generator=torch.Generator().manual_seed(5))
    dev = torch_device(device)
    out = minipaged_ops.paged_attention_decode(
        query.to(query_dtype).to(dev), key_cache.to(dev), value_cache.to(dev),
        (torch.arange(num_seqs, dtype=torch.int32) + 1)[:, None].to(dev),
        torch.ones(num_seqs, dtype=torch.int32, device=dev), head_dim**-0.5,
        key_scale=torch.ones(1, device=dev), value_scale=torch.full((1,), value_scale, device=dev))
    expected = value_bytes.to(torch.uint8).view(fmt).float().repeat_interleave(4, dim=1) * value_scale
    assert torch.equal(out.cpu().float(), expected)


@pytest.mark.parametrize("head_dim", [40, 80, 96])
@pytest.mark.parametrize("fmt", FORMATS, ids=FORMAT_IDS)
def test_cpu_other_head_dims(fmt, head_dim):
    # The CPU kernels' general paths and their element-by-element tails (head_dim not a multiple of 16).
    case = make_case(fmt, [20, 50, 3], 8, 2, head_dim, 16, torch.float32, "cpu", seed=head_dim)
    check_decode(case, head_dim**-0.5, torch.float32)
    pairs = [(20, 20), (50, 7), (3, 1)]
    case = make_case(fmt, [n for n, _ in pairs], 8, 2, head_dim, 16, torch.float32, "cpu", seed=head_dim,
                     query_rows=sum(q for _, q in pairs))
    case["cu_seqlens_q"] = torch.tensor([0, 20, 27, 28], dtype=torch.int32)
    check_prefill(case, head_dim**-0.5, torch.float32)


@pytest.mark.parametrize("shape", [((16, 2), 256, 16), ((10, 2), 128, 32), ((12, 4), 192, 16), ((4, 2), 32, 8)],
                         ids=["group8-256", "group5-128-b32", "group3-192", "group2-32-b8"])
@pytest.mark.parametrize("fmt", FORMATS, ids=FORMAT_IDS)
def test_cpu_decode_head_tiles(fmt, shape):
    # The CPU decode's tiles past the grid: groups of 5 and 8 (split into tiles of 4 + 1 and 4 + 4
    # heads), head_dim 256 and 32, 192 (int8's per-token path of vpdpwssd), odd lengths. float16
    # query: int8 caches then take the 16-bit integer dot products, checked at float16's tolerance.
    heads, head_dim, block_size = shape
    case = make_case(fmt, [3 * block_size + 5, 1, 2 * block_size, 101], *heads, head_dim, block_size, torch.float16,
                     "cpu", seed=seed_of("tiles", fmt, heads, head_dim))
    check_decode(case, head_dim**-0.5, torch.float16)


def prefill_case(fmt, pairs, heads, head_dim, block_size, query_dtype, device, seed):
    case = make_case(fmt, [n for n, _ in pairs], *heads, head_dim, block_size, query_dtype, device, seed=seed,
                     query_rows=sum(q for _, q in pairs))
    offsets = [0]
    for _, q in pairs:
        offsets.append(offsets[-1] + q)
    case["cu_seqlens_q"] = torch.tensor(offsets, dtype=torch.int32, device=case["query"].device)
    return case


@pytest.mark.parametrize("device", device_params())
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("heads", [(8, 2), (16, 8), (6, 2)], ids=lambda h: f"{h[0]}q{h[1]}kv")
@pytest.mark.parametrize("query_dtype", QUERY_DTYPES, ids=str)
@pytest.mark.parametrize("fmt", FORMATS, ids=FORMAT_IDS)
def test_prefill_grid(fmt, query_dtype, heads, head_dim, device):
    # Fresh prompts, chunks over history (mid-block and at a boundary), no new tokens, decode-like.
    pairs = [(0, 0), (1, 1), (37, 37), (53, 0), (49, 1), (75, 20), (64, 32)]
    case = prefill_case(fmt, pairs, heads, head_dim, 16, query_dtype, device,
                        seed_of("prefill", fmt, query_dtype, heads, head_dim))
    check_prefill(case, head_dim**-0.5, query_dtype)


@pytest.mark.parametrize("block_size", [1, 64])  # 16: the grids above
@pytest.mark.parametrize("head_dim", [36, 64, 128, 256])
@pytest.mark.parametrize("fmt", FORMATS, ids=FORMAT_IDS)
def test_cpu_prefill_lane_grid(fmt, head_dim, block_size):
    # The CPU prefill's lane path (head_dim 64, 128, 256: each chunk of keys dequantized once per
    # work item) and its generic path (36: not a multiple of 8), GQA groups 1, 3 and 8, blocks of
    # 1 and 64 (16: test_prefill_grid), odd lengths, poisoned pool; under whichever CPU variant runs.
    pairs = [(37, 37), (72, 19), (9, 3), (130, 65)]
    for group in (1, 3, 8):
        case = prefill_case(fmt, pairs, (2 * group, 2), head_dim, block_size, torch.float32, "cpu",
                            seed_of("lanes", fmt, group, head_dim, block_size))
        check_prefill(case, head_dim**-0.5, torch.float32)


@pytest.mark.parametrize("device", device_params())
@pytest.mark.parametrize("fmt", FORMATS, ids=FORMAT_IDS)
def test_prefill_one_token_each_equals_decode(fmt, device):
    pairs = [(1, 1), (33, 1), (700, 1)]
    case = prefill_case(fmt, pairs, (16, 8), 128, 16, torch.float32, device, seed_of("eq", fmt))
    prefill = minipaged_ops.paged_attention_prefill(**case, scale=0.09)
    decode_case = {k: v for k, v in case.items() if k != "cu_seqlens_q"}
    decode = minipaged_ops.paged_attention_decode(**decode_case, scale=0.09)
    torch.testing.assert_close(prefill, decode, atol=1e-5, rtol=1e-5)


# ---- copy_blocks: the scales travel with the bytes

@pytest.mark.parametrize("device", device_params())
@pytest.mark.parametrize("fmt", FORMATS, ids=FORMAT_IDS)
def test_copy_blocks_moves_scales_with_bytes(fmt, device):
    case = make_case(fmt, [40, 20], 8, 4, 64, 16, torch.float32, device, seed=3, spare_blocks=3)
    tensors = [case[k] for k in ("key_cache", "value_cache", "key_scale", "value_scale")]
    expected = [t.cpu().clone() for t in tensors]
    src = case["block_tables"][0, :2].cpu().long()
    num_blocks = case["key_cache"].shape[0]
    free = sorted(set(range(num_blocks)) - set(case["block_tables"].cpu().flatten().tolist()))
    mapping = torch.tensor([[int(src[0]), free[0]], [int(src[1]), free[1]]])
    reference.copy_blocks(*expected[:2], mapping, *expected[2:])
    minipaged_ops.copy_blocks(*tensors[:2], mapping.to(case["key_cache"].device), *tensors[2:])
    for got, want in zip(tensors, expected, strict=True):
        assert same_bits(got, want)
    # The copies read back as the originals through a table that names them.
    copied = dict(case, block_tables=torch.tensor([[free[0], free[1], -1]], dtype=torch.int32,
                                                  device=case["key_cache"].device),
                  seq_lens=case["seq_lens"][:1].clamp(max=32), query=case["query"][:1])
    original = dict(copied, block_tables=case["block_tables"][:1])
    assert torch.equal(minipaged_ops.paged_attention_decode(**copied, scale=0.1),
                       minipaged_ops.paged_attention_decode(**original, scale=0.1))


# ---- bad input: ValueError naming the argument, nothing written

def good_quantized_inputs(fmt, device):
    dev = torch_device(device)
    g = torch.Generator().manual_seed(0)
    key_cache, value_cache, ks, vs = poisoned_pool(fmt, 6, 2, 8, 64, dev)
    return dict(
        query=torch.randn(3, 4, 64, generator=g).to(dev),
        key=torch.randn(5, 2, 64, generator=g).to(dev),
        value=torch.randn(5, 2, 64, generator=g).to(dev),
        key_cache=key_cache, value_cache=value_cache, key_scale=ks, value_scale=vs,
        slot_mapping=torch.tensor([0, 9, -1, 47, 20], device=dev),
        block_tables=torch.tensor([[5, 1], [0, 2], [3, 4]], dtype=torch.int32, device=dev),
        seq_lens=torch.tensor([1, 2, 0], dtype=torch.int32, device=dev),
        cu_seqlens_q=torch.tensor([0, 1, 2, 2], dtype=torch.int32, device=dev),
        block_mapping=torch.tensor([[0, 3]], device=dev),
    )


def call_write(a):
    minipaged_ops.reshape_and_cache(a["key"], a["value"], a["key_cache"], a["value_cache"], a["slot_mapping"],
                                    a["key_scale"], a["value_scale"])


def call_decode(a):
    minipaged_ops.paged_attention_decode(a["query"], a["key_cache"], a["value_cache"], a["block_tables"],
                                         a["seq_lens"], 0.125, key_scale=a["key_scale"], value_scale=a["value_scale"])


def call_prefill(a):
    minipaged_ops.paged_attention_prefill(a["query"][:2], a["key_cache"], a["value_cache"], a["block_tables"],
                                          a["cu_seqlens_q"], a["seq_lens"], 0.125, key_scale=a["key_scale"],
                                          value_scale=a["value_scale"])


def call_copy(a):
    minipaged_ops.copy_blocks(a["key_cache"], a["value_cache"], a["block_mapping"], a["key_scale"], a["value_scale"])


ALL_OPS = [call_write, call_decode, call_prefill, call_copy]
LAYER_SCALE_OPS = [call_write, call_decode, call_prefill]  # copy_blocks never reads an fp8 layer scale
# (formats, ops, argument, replacement, text the message must contain)
BAD = [
    (FORMATS, ALL_OPS, "key_scale", lambda a: None, "key_scale: a {name} key_cache needs its scales"),
    (FORMATS, ALL_OPS, "value_scale", lambda a: None, "value_scale: a {name} key_cache needs its scales"),
    (FORMATS, ALL_OPS, "key_scale", lambda a: a["key_scale"].double(), "key_scale: expected dtype float32"),
    (FORMATS[:1], ALL_OPS, "key_scale", lambda a: a["key_scale"][:, :1],
     "key_scale: an int8 cache keeps one scale per token and kv head: expected shape [6, 2, 8]"),
    (FORMATS[:1], ALL_OPS, "value_scale", lambda a: torch.ones(1, device=a["key"].device),
     "value_scale: an int8 cache keeps one scale per token and kv head"),
    (FORMATS[1:], ALL_OPS, "key_scale", lambda a: torch.ones(6, 2, 8, device=a["key"].device),
     "key_scale: a {name} cache has one scale per layer: expected a tensor of one element"),
    (FORMATS[1:], LAYER_SCALE_OPS, "key_scale", lambda a: torch.zeros(1, device=a["key"].device),
     "key_scale: expected a finite scale > 0, got 0"),
    (FORMATS[1:], LAYER_SCALE_OPS, "value_scale", lambda a: torch.full((1,), -2.0, device=a["key"].device),
     "value_scale: expected a finite scale > 0, got -2"),
    (FORMATS[1:], LAYER_SCALE_OPS, "key_scale", lambda a: torch.full((1,), float("inf"), device=a["key"].device),
     "key_scale: expected a finite scale > 0, got inf"),
    (FORMATS[1:], LAYER_SCALE_OPS, "value_scale", lambda a: torch.full((1,), float("nan"), device=a["key"].device),
     "value_scale: expected a finite scale > 0, got nan"),
    (FORMATS, ALL_OPS, "value_cache", lambda a: a["value_cache"].view(torch.uint8).view(
        torch.float8_e5m2 if a["value_cache"].dtype != torch.float8_e5m2 else torch.int8),
     "value_cache: expected dtype {name} (that of key_cache)"),
    (FORMATS, [call_decode, call_prefill], "query", lambda a: a["query"].to(torch.int8),
     "query: expected dtype float32, float16 or bfloat16"),
    (FORMATS, [call_write], "key", lambda a: a["key"].double(), "key: expected dtype float32, float16 or bfloat16"),
    (FORMATS, [call_write], "value", lambda a: a["value"].half(), "value: expected dtype float32 (that of key)"),
]
NAMES = {torch.int8: "int8", torch.float8_e4m3fn: "float8_e4m3fn", torch.float8_e5m2: "float8_e5m2"}
BAD_CASES = [(fmt, op, arg, bad, text.format(name=NAMES[fmt]))
             for formats, ops, arg, bad, text in BAD for fmt in formats for op in ops]


@pytest.mark.parametrize("device", device_params())
@pytest.mark.parametrize("fmt,op,arg,bad,message", BAD_CASES,
                         ids=[f"{NAMES[c[0]]}-{c[1].__name__}-{c[2]}-{i}" for i, c in enumerate(BAD_CASES)])
def test_bad_input_is_a_value_error_and_writes_nothing(fmt, op, arg, bad, message, device, monkeypatch):
    monkeypatch.setenv("MINIPAGED_VALIDATE", "1")  # the CUDA path reads the fp8 layer scales only then
    op(good_quantized_inputs(fmt, device))  # the unmodified inputs are accepted
    a = good_quantized_inputs(fmt, device)
    call_write(a)  # something to lose
    names = ("key_cache", "value_cache", "key_scale", "value_scale")
    before = {k: a[k].clone() for k in names}
    a[arg] = bad(a)
    with pytest.raises(ValueError, match=re.escape(message)):
        op(a)
    for name in names:
        if name != arg:
            assert same_bits(a[name], before[name]), f"{name} was written although the input was rejected"


@pytest.mark.parametrize("device", device_params())
@pytest.mark.parametrize("op", ALL_OPS)
def test_float_cache_takes_no_scales(op, device):
    a = good_quantized_inputs(torch.int8, device)
    dev = torch_device(device)
    a["key_cache"], a["value_cache"] = torch.zeros(6, 2, 8, 64, device=dev), torch.zeros(6, 2, 8, 64, device=dev)
    with pytest.raises(ValueError, match=re.escape("key_scale: scales are for 8-bit caches (int8, float8_e4m3fn, "
                                                   "float8_e5m2), but key_cache is float32")):
        op(a)
    assert (a["key_cache"] == 0).all()


# ---- opcheck and torch.compile for every quantized form

def op_forms(fmt, device):
    case = make_case(fmt, [0, 5, 33], 8, 4, 64, 16, torch.bfloat16, device, seed=4)
    scales = (case["key_scale"], case["value_scale"])
    cache = (case["key_cache"], case["value_cache"])
    g = torch.Generator().manual_seed(1)
    kv = [torch.randn(3, 4, 64, generator=g).to(device, torch.bfloat16) for _ in range(2)]
    yield torch.ops.minipaged.reshape_and_cache.default, (*kv, *cache, torch.tensor([1, -1, 40], device=device),
                                                         *scales)
    yield torch.ops.minipaged.paged_attention_decode.default, (case["query"], *cache, case["block_tables"],
                                                              case["seq_lens"], 0.125, None, *scales)
    case = prefill_case(fmt, [(0, 0), (5, 5), (33, 7)], (8, 4), 64, 16, torch.float16, device, 4)
    yield torch.ops.minipaged.paged_attention_prefill.default, (
        case["query"], case["key_cache"], case["value_cache"], case["block_tables"], case["cu_seqlens_q"],
        case["seq_lens"], 0.125, None, case["key_scale"], case["value_scale"])
    free = min(set(range(case["key_cache"].shape[0])) - set(case["block_tables"].flatten().tolist()))
    yield torch.ops.minipaged.copy_blocks.default, (
        case["key_cache"], case["value_cache"], torch.tensor([[int(case["block_tables"][2, 0]), free]], device=device),
        case["key_scale"], case["value_scale"])


@pytest.mark.parametrize("device", device_params(emu=False))  # opcheck of torch.ops.minipaged itself
@pytest.mark.parametrize("fmt", FORMATS, ids=FORMAT_IDS)
def test_opcheck(fmt, device):
    # torch's schema check compares fp8 tensors with an op torch has no fp8 kernel for ("mul" is
    # "not implemented for 'Float8_e4m3fn'"), so fp8 runs the other checks; the schemas do not
    # depend on the format, and int8 runs all of them.
    utils = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
    for op, args in op_forms(fmt, device):
        torch.library.opcheck(op, args, test_utils=utils + (("test_schema",) if fmt == torch.int8 else ()))


@pytest.mark.parametrize("device", device_params())
@pytest.mark.parametrize("fmt", FORMATS, ids=FORMAT_IDS)
def test_compile_write_then_decode_matches_eager(fmt, device):
    torch._dynamo.reset()

    def step(query, key, value, key_cache, value_cache, slot_mapping, block_tables, seq_lens, key_scale, value_scale):
        minipaged_ops.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, key_scale, value_scale)
        return minipaged_ops.paged_attention_decode(query, key_cache, value_cache, block_tables, seq_lens, 0.125,
                                                    key_scale=key_scale, value_scale=value_scale) * 2

    dev = torch_device(device)
    g = torch.Generator().manual_seed(0)
    key_cache, value_cache, ks, vs = poisoned_pool(fmt, 8, 2, 16, 64, dev)
    # The history the decode reads: sequence 0 in blocks 1, 3; sequence 1 in blocks 7, 5.
    history = torch.tensor([16 + i for i in range(16)] + [48 + i for i in range(4)] +
                           [112 + i for i in range(16)], device=dev)
    minipaged_ops.reshape_and_cache(torch.randn(36, 2, 64, generator=g).to(dev),
                                    torch.randn(36, 2, 64, generator=g).to(dev), key_cache, value_cache, history, ks, vs)
    args = dict(
        query=torch.randn(2, 4, 64, generator=g).to(dev),
        key=torch.randn(2, 2, 64, generator=g).to(dev),
        value=torch.randn(2, 2, 64, generator=g).to(dev),
        slot_mapping=torch.tensor([3 * 16 + 4, 5 * 16 + 0], device=dev),
        block_tables=torch.tensor([[1, 3], [7, 5]], dtype=torch.int32, device=dev),
        seq_lens=torch.tensor([21, 17], dtype=torch.int32, device=dev),
    )
    eager = [t.clone() for t in (key_cache, value_cache, ks, vs)]
    expected = step(**args, key_cache=eager[0], value_cache=eager[1], key_scale=eager[2], value_scale=eager[3])
    got = torch.compile(step, fullgraph=True)(**args, key_cache=key_cache, value_cache=value_cache, key_scale=ks,
                                              value_scale=vs)
    torch.testing.assert_close(got, expected)
    for a, b in zip((key_cache, value_cache, ks, vs), eager, strict=True):
        assert same_bits(a, b), "in-place write lost under compile"
