"""The op library: schemas, opcheck, torch.compile, and loading."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import minipaged_ops
from conftest import DEVICES, device_params, make_paged_case


def test_schemas_are_defined_once_in_cpp():
    for name, schema in [
        ("reshape_and_cache", "minipaged::reshape_and_cache(Tensor key, Tensor value, Tensor(a!) key_cache, "
                              "Tensor(b!) value_cache, Tensor slot_mapping, Tensor(c!)? key_scale=None, "
                              "Tensor(d!)? value_scale=None) -> ()"),
        ("paged_attention_decode", "minipaged::paged_attention_decode(Tensor query, Tensor key_cache, "
                                   "Tensor value_cache, Tensor block_tables, Tensor seq_lens, float scale, "
                                   "int? max_seq_len=None, Tensor? key_scale=None, Tensor? value_scale=None) -> Tensor"),
        ("copy_blocks", "minipaged::copy_blocks(Tensor(a!) key_cache, Tensor(b!) value_cache, "
                        "Tensor block_mapping, Tensor(c!)? key_scale=None, Tensor(d!)? value_scale=None) -> ()"),
    ]:
        assert str(getattr(torch.ops.minipaged, name).default._schema) == schema


def test_backends_reported():
    backends = minipaged_ops.compiled_backends()
    assert "CPU" in backends
    if torch.version.cuda is not None and torch.cuda.is_available():
        assert "CUDA" in backends


def test_cuda_kernels_registered_when_built_for_cuda():
    """A CUDA torch plus nvcc (our CI) must compile and register the CUDA kernels, GPU or not."""
    import shutil

    if torch.version.cuda is None or shutil.which("nvcc") is None:
        pytest.skip("not the CUDA-torch + nvcc build row")
    assert minipaged_ops.compiled_backends() == ["CPU", "CUDA"]


def test_loading_twice_does_not_abort():
    code = (
        "import importlib, torch, minipaged_ops, minipaged_ops._C as c\n"
        "torch.ops.load_library(c.__file__)\n"
        "importlib.reload(minipaged_ops)\n"
        "print(minipaged_ops.compiled_backends())\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "CPU" in done.stdout


def test_import_does_not_import_transformers():
    code = "import sys, minipaged_ops; print('transformers' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "False", done.stderr


def decode_args(device, dtype=torch.float32):
    case = make_paged_case([0, 5, 33], 8, 4, 64, 16, dtype, device, seed=4)
    return (case["query"], case["key_cache"], case["value_cache"], case["block_tables"], case["seq_lens"], 0.125)


@pytest.mark.parametrize("device", device_params(emu=False))  # opcheck of torch.ops.minipaged itself
def test_opcheck_paged_attention_decode(device):
    torch.library.opcheck(torch.ops.minipaged.paged_attention_decode.default, decode_args(device))


@pytest.mark.parametrize("device", device_params(emu=False))  # opcheck of torch.ops.minipaged itself
def test_opcheck_reshape_and_cache(device):
    kc = torch.zeros(4, 2, 16, 64, device=device)
    args = (torch.randn(5, 2, 64, device=device), torch.randn(5, 2, 64, device=device), kc, torch.zeros_like(kc),
            torch.tensor([3, -1, 17, 63, 0], device=device))
    torch.library.opcheck(torch.ops.minipaged.reshape_and_cache.default, args)


@pytest.mark.parametrize("device", device_params(emu=False))  # opcheck of torch.ops.minipaged itself
def test_opcheck_copy_blocks(device):
    kc = torch.randn(4, 2, 16, 64, device=device)
    args = (kc, torch.randn_like(kc), torch.tensor([[0, 2], [1, 3]], device=device))
    torch.library.opcheck(torch.ops.minipaged.copy_blocks.default, args)


@pytest.mark.parametrize("device", DEVICES)
def test_compile_write_then_decode_matches_eager(device):
    torch._dynamo.reset()

    def step(query, key, value, key_cache, value_cache, slot_mapping, block_tables, seq_lens):
        minipaged_ops.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)
        return minipaged_ops.paged_attention_decode(query, key_cache, value_cache, block_tables, seq_lens, 0.125) * 2

    g = torch.Generator().manual_seed(0)
    key_cache = torch.randn(8, 2, 16, 64, generator=g).to(device)
    value_cache = torch.randn(8, 2, 16, 64, generator=g).to(device)
    args = dict(
        query=torch.randn(2, 4, 64, generator=g).to(device),
        key=torch.randn(2, 2, 64, generator=g).to(device),
        value=torch.randn(2, 2, 64, generator=g).to(device),
        slot_mapping=torch.tensor([3 * 16 + 4, 5 * 16 + 0], device=device),
        block_tables=torch.tensor([[1, 3], [7, 5]], dtype=torch.int32, device=device),
        seq_lens=torch.tensor([21, 17], dtype=torch.int32, device=device),
    )
    eager_k, eager_v = key_cache.clone(), value_cache.clone()
    expected = step(key_cache=eager_k, value_cache=eager_v, **args)
    compiled = torch.compile(step, fullgraph=True)
    got = compiled(key_cache=key_cache, value_cache=value_cache, **args)
    torch.testing.assert_close(got, expected)
    assert torch.equal(key_cache, eager_k) and torch.equal(value_cache, eager_v), "in-place write lost under compile"
