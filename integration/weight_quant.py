"""Weight-only quantization of a model's linear layers: ``quantization="int8"`` (a scale per output
channel) or ``"int4"`` (asymmetric, a scale and zero point per group of 32 input columns: 5 bits a
weight, beside llama.cpp's Q4_0 at 4.5), quantized from the weights rounded to bfloat16; the layers
take and return the model's dtype.

torchao (the PyTorch quantization library) computes the quantized values and scales
(``Int8Tensor.from_hp`` per row; int4 with HQQ's fitted scales and zero points). Both multiply
through ``minipaged_ops.linear_widened``: decode steps (up to 24 rows) stream the quantized
weight once, widened to float32 in registers; prompts widen a block of rows at a time into
oneDNN's bfloat16 GEMM where the CPU has bfloat16 dot products, the float32 GEMM elsewhere. With
ATen's ``_weight_int8pack_mm`` the server lost to llama.cpp's Q8_0, and with
``_weight_int4pack_mm_for_cpu`` its prompts took 1.5-2x llama.cpp's TTFT (bench/RESULTS.md).
torchao's own int8 linear would widen the whole weight to the activations' dtype on every call
and multiply in bfloat16, the slow path CPUs without bfloat16 instructions take. CPU only; the
lm_head is quantized too (as llama.cpp's Q8_0 / Q4_0 files do); a tied input embedding keeps its
16-bit rows for the lookups.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn

import minipaged_ops

from .linear16 import WidenedLinear, widens

__all__ = ["Int4Linear", "Int8Linear", "QUANTIZATIONS", "check_quantization", "describe_weights", "quantize_weights"]

QUANTIZATIONS = ("int8", "int4")
# The smallest group torchao's CPU int4 packing takes: on bench/weight_quality.py's model, groups of
# 32 halve the KL of groups of 64 and quarter that of 128 (bench/RESULTS.md), for ~3% of the
# kernel's speed at 1-256 rows.
INT4_GROUP_SIZE = 32
# Weights are rounded to bfloat16 before quantizing (a checkpoint's format) and scales kept in it.
SCALE_DTYPE = torch.bfloat16


def check_quantization(quantization, device: Optional[torch.device] = None, tensor_parallel_size: int = 1) -> None:
    """ValueError naming ``quantization`` unless it is None or one of :data:`QUANTIZATIONS`, on a
    CPU (where ``device`` is given) and without tensor parallelism."""
    if quantization is None:
        return
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be None or one of {list(QUANTIZATIONS)}, got {quantization!r}")
    if device is not None and torch.device(device).type != "cpu":
        raise ValueError(f"quantization={quantization!r}: weight-only quantization runs on the CPU only, "
                         f"the model is on {torch.device(device).type}")
    if tensor_parallel_size != 1:
        raise ValueError(f"quantization={quantization!r} does not work with tensor_parallel_size={tensor_parallel_size}: "
                         "the tensor-parallel split slices 16-bit nn.Linear weights")


class Int8Linear(nn.Module):
    """``x @ (qweight * scale).T + bias``: int8 weight [out, in], one scale per output channel."""

    def __init__(self, qweight: torch.Tensor, scale: torch.Tensor, bias: Optional[torch.Tensor]):
        super().__init__()
        self.in_features, self.out_features = qweight.shape[1], qweight.shape[0]
        self.register_buffer("qweight", qweight)
        self.register_buffer("scale", scale)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> "Int8Linear":
        from torchao.quantization.granularity import PerRow
        from torchao.quantization.quantize_.workflows.int8.int8_tensor import Int8Tensor

        quantized = Int8Tensor.from_hp(linear.weight.detach().to(SCALE_DTYPE), PerRow())
        bias = None if linear.bias is None else linear.bias.detach().clone()
        return cls(quantized.qdata.contiguous(), quantized.scale.reshape(-1).to(SCALE_DTYPE), bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return minipaged_ops.linear_widened(x, self.qweight, self.bias, weight_scale=self.scale)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 per channel"


class Int4Linear(nn.Module):
    """``(x * column_scale) @ ((q - zero) * scale).T + bias``: int4 weight ``q`` two a byte
    (``packed`` ``[out, in / 2]``, minipaged_ops.linear_widened's layout), ``scale`` and ``zero``
    bfloat16 ``[out, in / group_size]``, ``column_scale`` float32 ``[in]``."""

    def __init__(self, packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, column_scale: torch.Tensor,
                 group_size: int, bias: Optional[torch.Tensor]):
        super().__init__()
        self.in_features, self.out_features, self.group_size = packed.shape[1] * 2, packed.shape[0], group_size
        self.register_buffer("packed", packed)
        self.register_buffer("scale", scale)
        self.register_buffer("zero", zero)
        self.register_buffer("column_scale", column_scale)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    @classmethod
    def from_linear(cls, linear: nn.Linear, group_size: int) -> "Int4Linear":
        from torchao.quantization.quant_primitives import _choose_qparams_and_quantize_affine_hqq

        weight = linear.weight.detach().to(SCALE_DTYPE).float()
        # Input columns equalized first (SmoothQuant's and AWQ's equivalent transformation, from the
        # weights' own column maxima as there is no calibration data): W = (W / c) * c, the input
        # multiplied by c. A column far larger than its group's others would otherwise take the
        # group's 16 levels for itself. c = (max / median max) ** 0.5, SmoothQuant's default
        # strength; on bench/weight_quality.py's model (3 seeds) it halves the mean KL (0.024 ->
        # 0.012; strength 0.25: 0.015, 0.75: 0.014, 1: 0.027) and greedy agreement 82% -> 93%.
        column_max = weight.abs().amax(0)
        column_scale = torch.where(column_max > 0, column_max / column_max[column_max > 0].median(), 1.0)
        column_scale = column_scale.sqrt() if column_max.any() else torch.ones_like(column_max)
        # HQQ's scales and zero points (fitted to the weights) rather than each group's min and max:
        # on bench/weight_quality.py's model, greedy agreement 0.35 -> 0.9 and KL 0.12 -> 0.07 (20 requests)
        q, scale, zero, _ = _choose_qparams_and_quantize_affine_hqq(
            (weight / column_scale).to(SCALE_DTYPE), nbits=4, group_size=group_size, axis=1,
            compute_dtype=SCALE_DTYPE, device="cpu", raw_output=True)
        n, k = q.shape
        halves = q.reshape(n, k // 32, 2, 16)  # each 32 weights: the first 16 in low nibbles, the rest in high
        packed = (halves[:, :, 0] | (halves[:, :, 1] << 4)).reshape(n, k // 2).contiguous()
        bias = None if linear.bias is None else linear.bias.detach().clone()
        return cls(packed, scale.contiguous(), zero.contiguous(), column_scale, group_size, bias)

    def dequantized(self) -> torch.Tensor:
        """The weight the layer multiplies by, as float32 ``[out, in]`` (for tests and references)."""
        low, high = self.packed & 0xF, self.packed >> 4
        q = torch.stack([low.reshape(self.out_features, -1, 16), high.reshape(self.out_features, -1, 16)], dim=2)
        q = q.reshape(self.out_features, -1, self.group_size).float()
        w = ((q - self.zero.float()[..., None]) * self.scale.float()[..., None]).reshape(self.out_features, -1)
        return w * self.column_scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        columns = (x * self.column_scale).to(x.dtype)
        return minipaged_ops.linear_widened(columns, self.packed, self.bias, weight_scale=self.scale,
                                            weight_zero=self.zero)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int4 group {self.group_size}"


def _int4_group(linear: nn.Linear) -> Optional[int]:
    return INT4_GROUP_SIZE if linear.in_features % INT4_GROUP_SIZE == 0 else None


@torch.no_grad()
def quantize_weights(model: nn.Module, quantization: str) -> int:
    """Replace every ``nn.Linear`` of ``model`` (a CPU model) by its quantized layer, in place;
    returns how many. ValueError naming ``quantization`` (nothing changed) for an unknown value, a
    model on another device, or one with a layer it cannot quantize."""
    check_quantization(quantization, next(model.parameters()).device)
    try:
        import torchao  # noqa: F401
    except ImportError:
        raise ValueError(f"quantization={quantization!r} needs torchao: pip install 'minipaged[quantization]'") from None
    linears = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    if not linears:
        raise ValueError(f"quantization={quantization!r}: {type(model).__name__} has no nn.Linear layer to quantize")
    for name, m in linears:
        if type(m) not in (nn.Linear, WidenedLinear):  # a subclass's forward would be lost
            raise ValueError(f"quantization={quantization!r}: {name} is a {type(m).__name__}, not a plain nn.Linear")
        if quantization == "int4" and _int4_group(m) is None:
            raise ValueError(f"quantization='int4': {name} has {m.in_features} input features; int4 groups of "
                             f"{INT4_GROUP_SIZE} need a multiple of {INT4_GROUP_SIZE}")
    for name, m in linears:
        layer = Int8Linear.from_linear(m) if quantization == "int8" else Int4Linear.from_linear(m, _int4_group(m))
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, layer)
    return len(linears)


def describe_weights(model: nn.Module) -> dict:
    """``{"weight_format", "weight_bytes"}`` for stats() and /metrics: the formats of the model's
    linear layers ("int8", "int4 (group 32)", "bfloat16 (float32 arithmetic)" where
    :func:`.linear16.widens`, ...; several joined by " + ") and the bytes of its parameters and
    buffers, each storage counted once (tied weights)."""
    formats = []
    for m in model.modules():
        if isinstance(m, Int8Linear):
            name = "int8"
        elif isinstance(m, Int4Linear):
            name = f"int4 (group {m.group_size})"
        elif isinstance(m, nn.Linear):
            widened = m.weight.dtype != torch.float32 and widens(m.weight)
            name = str(m.weight.dtype).removeprefix("torch.") + (" (float32 arithmetic)" if widened else "")
        else:
            continue
        if name not in formats:
            formats.append(name)
    storages = {}
    for t in [*model.parameters(), *model.buffers()]:
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return {"weight_format": " + ".join(formats) or "none", "weight_bytes": sum(storages.values())}
