"""The engine's CPU linear layers: bfloat16 and float16 weights at float32 speed on CPUs without
16-bit dot products, and few-row steps (decode, speculative verify) at memory speed.

On such a CPU (AVX2, or AVX-512 without AVX512-BF16 / AMX) torch's own bfloat16 matmul takes a slow
generic path, several times slower than float32 (bench/RESULTS.md). ``linear`` sends a CPU linear
with a 16-bit weight to ``minipaged_ops.linear_widened`` there: the weight stays 16-bit in memory
and is widened to float32 in registers (few rows) or a block of rows at a time into the float32
GEMM. Where the CPU has the instructions (the kernels' variant is ``avx512_bf16`` or
``avx512_amx``; for float16, AMX-FP16) torch's own path (oneDNN) is used, as it is native there.
A float32 weight goes through the op too: with few input rows the op reads the weight once for
all of them, where the build's GEMM (MKL) takes about one weight read per row on AMD CPUs.

``MINIPAGED_CPU_ISA=avx2`` (read when minipaged loads) makes a CPU that has them choose as one
without them would; see README's "bfloat16 checkpoints on the CPU".
"""

from __future__ import annotations

import functools

import torch
import torch.nn as nn
import torch.nn.functional as F

import minipaged_ops

__all__ = ["WidenedLinear", "cpu_flags", "linear", "native_16bit_matmul", "widen_linears"]

_16BIT = (torch.bfloat16, torch.float16)


@functools.cache
def native_16bit_matmul(dtype: torch.dtype) -> bool:
    """Whether this CPU multiplies ``dtype`` matrices natively (so torch's own linear is fast)."""
    isa = minipaged_ops.cpu_isa()
    if dtype == torch.bfloat16:
        return isa in ("avx512_bf16", "avx512_amx")
    return isa == "avx512_amx" and "amx_fp16" in cpu_flags()


@functools.cache
def cpu_flags() -> frozenset:
    """The CPU's feature flags as Linux names them (empty elsewhere): torch has no public query for
    AMX-FP16, and its private one is gone from torch 2.14."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((frozenset(line.split(":", 1)[1].split()) for line in f if line.startswith("flags")),
                        frozenset())
    except OSError:
        return frozenset()


def widens(weight: torch.Tensor) -> bool:
    """Whether :func:`linear` computes with this weight through ``linear_widened``."""
    if weight.device.type != "cpu":
        return False
    return weight.dtype == torch.float32 or (weight.dtype in _16BIT and not native_16bit_matmul(weight.dtype))


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear``, with a CPU weight computed by ``linear_widened`` where :func:`widens` says so."""
    if widens(weight):
        return minipaged_ops.linear_widened(x, weight, bias)
    return F.linear(x, weight, bias)


class WidenedLinear(nn.Linear):
    """An ``nn.Linear`` that computes through :func:`linear`; same parameters, same state dict."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


def widen_linears(model: nn.Module) -> int:
    """Make every plain ``nn.Linear`` of ``model`` whose weight :func:`widens` a
    :class:`WidenedLinear` (in place: the class changes, the parameters stay). Returns how many."""
    count = 0
    for module in model.modules():
        if type(module) is nn.Linear and widens(module.weight):
            module.__class__ = WidenedLinear
            count += 1
    return count
