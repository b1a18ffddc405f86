"""float32, bfloat16, float16, int8 and int4 weights computed in float32 (minipaged_ops.linear_widened,
integration.linear16): the op against a float64 reference on fresh random inputs of odd shapes
(streamed few-row steps, several weight blocks, a partial last one, zero rows), its errors, and the
engine keeping a 16-bit model's weights 16-bit."""

from __future__ import annotations

import pytest
import torch

import minipaged_ops

WEIGHT_DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# (rows, in_features, out_features). Up to 24 rows the weight is streamed (row counts 1-9, 13, 20,
# 23 and 24: groups of 4 rows with a partial last group, an odd last weight row, vector tails);
# more rows take the GEMM path (and every row count on the scalar variant), with a weight of several
# blocks of rows and a partial last one (1024 inputs: the 128-row minimum; 300 inputs on the scalar
# variant: 218-row blocks), zero rows and zero inputs.
SHAPES = [(1, 1, 1), (2, 16, 3), (3, 7, 5), (4, 1029, 70), (5, 300, 1000), (6, 33, 129), (7, 48, 9),
          (8, 1024, 257), (9, 33, 17), (13, 2053, 200), (20, 520, 64), (23, 77, 5), (24, 64, 40), (25, 40, 33),
          (37, 65, 129), (30, 1024, 300), (2, 40000, 13), (5, 5, 2), (0, 16, 8), (4, 0, 6)]


def reference(x, w, b):
    out = x.double() @ w.double().T
    return out if b is None else out + b.double()


@pytest.mark.parametrize("wdtype", WEIGHT_DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("with_bias", [False, True], ids=["nobias", "bias"])
def test_matches_float64_reference(wdtype, shape, with_bias):
    rows, k, n = shape
    g = torch.Generator().manual_seed(hash((rows, k, n, with_bias)) % 2**31)
    x = torch.randn(rows, k, generator=g)
    w = torch.randn(n, k, generator=g).to(wdtype)
    b = torch.randn(n, generator=g) if with_bias else None
    out = minipaged_ops.linear_widened(x, w, b)
    assert out.dtype == torch.float32 and out.shape == (rows, n)
    ref = reference(x, w, b)
    # float32 accumulation of k products of unit-variance terms: error ~ sqrt(k) * 2^-24 * |terms|
    tol = 1e-5 * max(k, 1) ** 0.5 * 4
    torch.testing.assert_close(out.double(), ref, atol=tol, rtol=1e-5)


@pytest.mark.parametrize("xdtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_batched_input_keeps_its_dtype_and_leading_dims(xdtype):
    x = torch.randn(2, 3, 48).to(xdtype)
    w = torch.randn(20, 48).to(torch.bfloat16)
    b = torch.randn(20).to(torch.bfloat16)
    out = minipaged_ops.linear_widened(x, w, b)
    assert out.dtype == xdtype and out.shape == (2, 3, 20)
    torch.testing.assert_close(out.double(), reference(x, w, b), atol=4e-2, rtol=1.6e-2)


@pytest.mark.parametrize("mode", ["inference_mode", "no_grad"])
def test_inference_tensors_on_every_thread(mode):
    """The blocks run on torch's thread pool; an inference-mode caller's tensors must stay usable there."""
    with getattr(torch, mode)():
        x = torch.randn(7, 64)
        w = torch.randn(4000, 64).to(torch.bfloat16)  # 4000 rows: blocks for every thread
        out = minipaged_ops.linear_widened(x, w)
    torch.testing.assert_close(out.double(), reference(x, w, None), atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.bfloat16], ids=str)
def test_int8_weight_with_a_scale_per_output_row(shape, scale_dtype):
    rows, k, n = shape
    g = torch.Generator().manual_seed(hash((rows, k, n, "int8")) % 2**31)
    x = torch.randn(rows, k, generator=g)
    w = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)  # -128 and 127 included
    scale = (torch.rand(n, generator=g) * 0.02 + 1e-3).to(scale_dtype)
    b = torch.randn(n, generator=g)
    out = minipaged_ops.linear_widened(x, w, b, weight_scale=scale)
    assert out.dtype == torch.float32 and out.shape == (rows, n)
    ref = (x.double() @ w.double().T) * scale.double() + b.double()
    # |w| up to 128: float32 sums of k terms ~128x larger than the float tests' (then scaled by ~0.01)
    tol, rtol = 1e-5 * max(k, 1) ** 0.5 * 4 * 128 * 0.021, 1e-5
    if rows > 24 and minipaged_ops.cpu_isa() in ("avx512_bf16", "avx512_amx"):
        # the GEMM path runs in bfloat16 there: inputs and the product rounded to 8 significant bits
        tol, rtol = 2**-8 * max(k, 1) ** 0.5 * 4 * 128 * 0.021, 2**-7
    torch.testing.assert_close(out.double(), ref, atol=tol, rtol=rtol)


# (rows, in_features, out_features, group): streamed (<= 24 rows: groups of 4 rows and a partial
# last one, an odd last weight row) and GEMM paths, groups of 32 to 256 columns and a group of 96
# (three 32-weight chunks), several weight blocks and a partial last one, zero rows and zero inputs.
INT4_SHAPES = [(1, 32, 1, 32), (2, 64, 3, 32), (3, 96, 5, 96), (4, 1024, 70, 32), (5, 320, 1000, 64),
               (7, 128, 9, 128), (8, 1024, 257, 32), (9, 2048, 17, 256), (13, 2080, 200, 32), (20, 512, 64, 256),
               (23, 96, 5, 32), (24, 64, 40, 32), (25, 64, 33, 32), (37, 96, 129, 32), (40, 1024, 300, 128),
               (2, 40000, 13, 32), (0, 32, 8, 32), (4, 0, 6, 0)]


def int4_case(rows, k, n, group, scale_dtype, seed):
    """x, packed weight, scale, zero, bias, and the dequantized weight in float64."""
    g = torch.Generator().manual_seed(seed)
    groups = k // group if group else 1
    q = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    if q.numel():
        q.view(-1)[:2] = torch.tensor([0, 15], dtype=torch.uint8)  # both ends of the range
    scale = (torch.rand(n, groups, generator=g) * 0.02 + 1e-3).to(scale_dtype)
    zero = (torch.rand(n, groups, generator=g) * 15).to(scale_dtype)
    halves = q.reshape(n, -1, 2, 16)
    packed = (halves[:, :, 0] | (halves[:, :, 1] << 4)).reshape(n, k // 2)
    per_column = lambda t: t.double().repeat_interleave(group, dim=1) if group else t.double()[:, :0]
    dequantized = (q.double() - per_column(zero)) * per_column(scale)
    return torch.randn(rows, k, generator=g), packed, scale, zero, torch.randn(n, generator=g), dequantized


@pytest.mark.parametrize("shape", INT4_SHAPES, ids=str)
@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.bfloat16], ids=str)
def test_int4_weight_with_a_scale_and_zero_per_group(shape, scale_dtype):
    rows, k, n, group = shape
    x, packed, scale, zero, b, dequantized = int4_case(*shape, scale_dtype, seed=hash((shape, "int4")) % 2**31)
    out = minipaged_ops.linear_widened(x, packed, b, weight_scale=scale, weight_zero=zero)
    assert out.dtype == torch.float32 and out.shape == (rows, n)
    ref = x.double() @ dequantized.T + b.double()
    # |w| up to ~15 scales of 0.021: float32 sums of k such terms
    tol, rtol = 1e-5 * max(k, 1) ** 0.5 * 4 * 16 * 0.021, 1e-5
    if rows > 24 and minipaged_ops.cpu_isa() in ("avx512_bf16", "avx512_amx"):
        # the GEMM path runs in bfloat16 there: inputs, dequantized weights and the product rounded
        tol, rtol = 2**-8 * max(k, 1) ** 0.5 * 4 * 16 * 0.021, 2**-7
    torch.testing.assert_close(out.double(), ref, atol=tol, rtol=rtol)


def test_non_contiguous_weight_and_input():
    w = torch.randn(64, 40).to(torch.bfloat16)[::2, 3:35]  # strided view
    x = torch.randn(40, 5).T[:, 3:35]  # [5, 32], non-contiguous
    out = minipaged_ops.linear_widened(x, w)
    torch.testing.assert_close(out.double(), reference(x, w, None), atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("args, match", [
    ((torch.randn(2, 8), torch.randn(4, 8).double()), "float32, bfloat16, float16, int8 or uint8"),
    ((torch.randn(2, 8), torch.ones(4, 8, dtype=torch.int8)), "weight_scale .* only with it; weight is Char, "
                                                               "weight_scale not given"),
    ((torch.randn(2, 64), torch.ones(4, 32, dtype=torch.uint8), None, torch.ones(4, 2)),
     "weight_zero .* only with it; weight is Byte, weight_zero not given"),
    ((torch.randn(2, 64), torch.ones(4, 32, dtype=torch.uint8), None, None, torch.ones(4, 2)),
     "weight_scale .* only with it; weight is Byte, weight_scale not given"),
    ((torch.randn(2, 8), torch.ones(4, 8, dtype=torch.int8), None, torch.ones(4), torch.ones(4)),
     "weight_zero .* only with it; weight is Char, weight_zero given"),
    ((torch.randn(2, 64), torch.ones(4, 32, dtype=torch.uint8), None, torch.ones(4, 2), torch.ones(4, 2).bfloat16()),
     r"weight_scale and weight_zero must both be float32 or both bfloat16, \[4, groups\]"),
    ((torch.randn(2, 64), torch.ones(4, 32, dtype=torch.uint8), None, torch.ones(4, 2).half(), torch.ones(4, 2).half()),
     "must both be float32 or both bfloat16"),
    ((torch.randn(2, 64), torch.ones(4, 32, dtype=torch.uint8), None, torch.ones(4), torch.ones(4)),
     "must both be float32 or both bfloat16"),
    ((torch.randn(2, 64), torch.ones(4, 32, dtype=torch.uint8), None, torch.ones(4, 4), torch.ones(4, 4)),
     "groups must be whole multiples of 32 input columns; 64 columns .* in 4 groups"),
    ((torch.randn(2, 64), torch.ones(4, 32, dtype=torch.uint8), None, torch.ones(4, 3), torch.ones(4, 3)),
     "whole multiples of 32"),
    ((torch.randn(2, 32), torch.ones(4, 32, dtype=torch.uint8), None, torch.ones(4, 2), torch.ones(4, 2)),
     r"must equal weight's in_features \(64: two a byte\)"),
    ((torch.randn(2, 8), torch.randn(4, 8), None, torch.ones(4)), "weight_scale .*weight is Float, weight_scale given"),
    ((torch.randn(2, 8), torch.ones(4, 8, dtype=torch.int8), None, torch.ones(5)), r"weight_scale must be a "
                                                                                 r"floating-point \[4\]"),
    ((torch.randn(2, 8), torch.ones(4, 8, dtype=torch.int8), None, torch.ones(4, dtype=torch.int32)),
     "weight_scale must be a floating-point"),
    ((torch.randn(2, 8), torch.randn(4, 9).bfloat16()), "in_features"),
    ((torch.randn(2, 8), torch.randn(4, 8, 1).bfloat16()), "2-D"),
    ((torch.randn(2, 8), torch.randn(4, 8).bfloat16(), torch.randn(5)), "bias"),
    ((torch.randint(0, 3, (2, 8)), torch.randn(4, 8).bfloat16()), "floating point"),
])
def test_rejects_bad_arguments(args, match):
    with pytest.raises(RuntimeError, match=match):
        minipaged_ops.linear_widened(*args)


def test_engine_keeps_16bit_weights_and_says_so():
    pytest.importorskip("transformers")
    from minipaged_ops.integration import LLMEngine, SamplingParams
    from minipaged_ops.integration.linear16 import WidenedLinear
    from minipaged_ops.tiny import tiny_model

    model = tiny_model("qwen3", dtype=torch.bfloat16)
    reference = [model.generate(torch.tensor([p]), max_new_tokens=6, do_sample=False)[0, len(p):].tolist()
                 for p in ([3, 4, 5], [7, 8, 9, 10, 11])]
    ptrs = {n: p.data_ptr() for n, p in model.named_parameters()}
    engine = LLMEngine(model, num_blocks=32, block_size=16)
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert all(m.weight.dtype == torch.bfloat16 for m in linears)
    assert {n: p.data_ptr() for n, p in model.named_parameters()} == ptrs  # no copy of any weight
    stats = engine.stats()
    params_bytes = sum(p.numel() * 2 for p in model.parameters())
    assert params_bytes <= stats["weight_bytes"] <= params_bytes + 4096  # + the rotary tables; no float32 copy
    if minipaged_ops.cpu_isa() not in ("avx512_bf16", "avx512_amx"):  # no bfloat16 dot products (or told so)
        assert all(type(m) is WidenedLinear for m in linears)
        assert stats["weight_format"] == "bfloat16 (float32 arithmetic)"
    else:
        assert not any(type(m) is WidenedLinear for m in linears)
        assert stats["weight_format"] == "bfloat16"
    outs = engine.generate([[3, 4, 5], [7, 8, 9, 10, 11]], SamplingParams(max_tokens=6), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == reference


@pytest.mark.parametrize("weight, scale", [
    (torch.randn(40, 24), None),
    (torch.randn(40, 24).bfloat16(), None),
    (torch.randint(-128, 128, (40, 64), dtype=torch.int8), torch.rand(40) * 0.01),
    (torch.randint(0, 256, (40, 32), dtype=torch.uint8), (torch.rand(40, 2) * 0.01, torch.rand(40, 2) * 15)),
], ids=["float32", "bfloat16", "int8", "int4"])
@pytest.mark.parametrize("rows", [3, 30], ids=["streamed", "gemm"])
def test_opcheck(weight, scale, rows):
    # schema, fake (torch.compile's shapes) and the op agree
    scale, zero = scale if isinstance(scale, tuple) else (scale, None)
    in_features = 64 if weight.dtype == torch.uint8 or weight.dtype == torch.int8 else 24
    args = (torch.randn(rows, in_features), weight, torch.randn(40), scale, zero)
    torch.library.opcheck(torch.ops.minipaged.linear_widened.default, args)
