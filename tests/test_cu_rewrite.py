"""The CUDA emulation's source rewrite (src_cuda/emulation/cu_to_cpp.py) and its load."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from minipaged_ops import emulation

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("cu_to_cpp", ROOT / "src_cuda" / "emulation" / "cu_to_cpp.py")
cu_to_cpp = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(cu_to_cpp)


def test_launches_become_calls():
    src = ("  if (ok) k<float, 3><<<dim3(a, b), 128, smem, stream>>>(x, y);\n"
           "  other<<<n, 32>>>();\n")
    out = cu_to_cpp.rewrite(src)
    assert "::emu::launch(::emu::config(dim3(a, b), 128, smem, stream), [](auto... xs) { k<float, 3>(xs...); }, x, y);" in out
    assert "::emu::launch(::emu::config(n, 32), [](auto... xs) { other(xs...); });" in out
    assert "<<<" not in out


def test_shared_declarations():
    out = cu_to_cpp.rewrite("extern __shared__ __align__(16) float smem[];\n__shared__ float tile[4][8];\n")
    assert "float* smem = ::emu::dynamic_shared<float>();" in out
    assert "float (&tile)[4][8] = *reinterpret_cast<float (*)[4][8]>(::emu::static_shared(" in out


def test_every_cuda_source_rewrites():
    for cu in (ROOT / "src_cuda" / "cuda").glob("*.cu"):
        out = cu_to_cpp.rewrite(cu.read_text())
        assert "<<<" not in out and "extern __shared__" not in out, cu.name


@pytest.mark.skipif(not emulation.available(), reason="no CUDA emulation in this build")
def test_mirror_ops_have_the_real_schemas():
    for name in ("paged_attention_decode", "reshape_and_cache", "copy_blocks"):
        real = str(getattr(torch.ops.minipaged, name).default._schema)
        emu = str(getattr(torch.ops.minipaged_emu, name).default._schema)
        assert emu == real.replace("minipaged::", "minipaged_emu::")
