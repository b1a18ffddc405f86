"""torch.compile of Qwen3 on a PagedKVCache: same tokens as eager sdpa, no graph break, no
recompilation per decode step, the cache pools updated in place (never copied)."""

from __future__ import annotations

import re

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("minipaged_ops.integration")

import torch._dynamo  # noqa: E402
from torch._dynamo.utils import counters  # noqa: E402
from transformers import CompileConfig  # noqa: E402

from minipaged_ops.integration import PagedKVCache, _compat  # noqa: E402
from minipaged_ops.tiny import PAD, tiny_model  # noqa: E402

pytestmark = pytest.mark.filterwarnings("error::FutureWarning")


def fresh_model(seed=0, heads=4, kv_heads=2, head_dim=64):
    return tiny_model("qwen3", vocab=160, max_positions=256, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                      seed=seed)


def padded_batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 160, (3, 11), generator=g)
    mask = torch.ones(3, 11, dtype=torch.long)
    mask[1, :4] = 0
    mask[2, :9] = 0
    ids[mask == 0] = PAD
    return ids, mask


def reference(model, ids, mask, n):
    model.set_attn_implementation("sdpa")
    with torch.no_grad():
        return model.generate(ids, attention_mask=mask, max_new_tokens=n, do_sample=False)


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def test_compiled_forward_fullgraph_inductor_no_recompile_no_pool_copy():
    from torch._inductor.utils import run_and_get_code

    model = fresh_model()
    ids, mask = padded_batch()
    ref = reference(model, ids, mask, 64)
    model.set_attn_implementation("minipaged")
    cache = PagedKVCache(model, num_blocks=48, block_size=8, dtype=torch.float32, device="cpu")
    model.forward = torch.compile(model.forward, fullgraph=True)  # raises on any graph break

    def run():
        with torch.no_grad():
            return model.generate(ids, attention_mask=mask, **_compat.cache_kwargs(cache), max_new_tokens=64,
                                  do_sample=False)

    pools = [t.data_ptr() for t in cache.key_cache + cache.value_cache]
    out, codes = run_and_get_code(run)
    assert torch.equal(out, ref)
    # a 64-token generate compiles one prefill and one decode graph, nothing per step
    assert counters["stats"]["unique_graphs"] <= 2, dict(counters["stats"])
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert [t.data_ptr() for t in cache.key_cache + cache.value_cache] == pools
    # the ops write the pools in place: no buffer of the pool's shape is ever allocated
    pool_shape = "(48, 2, 8, 64)"
    decode = [c for c in codes if "paged_attention_decode" in c]
    assert decode, "no decode graph used the paged kernel"
    for code in codes:
        allocs = re.findall(r"empty_strided_\w+\((\([^)]*\))", code)
        assert pool_shape not in allocs
    assert "reshape_and_cache" in decode[0]
    # later generates with the same shapes reuse the graphs
    cache.reset()
    assert torch.equal(run(), ref)
    assert counters["stats"]["unique_graphs"] <= 2, dict(counters["stats"])


def test_transformers_compiled_generate_path():
    model = fresh_model(seed=1, heads=4, kv_heads=1, head_dim=128)
    ids, mask = padded_batch(seed=1)
    ref = reference(model, ids, mask, 40)
    model.set_attn_implementation("minipaged")
    cache = PagedKVCache(model, num_blocks=48, block_size=16)
    graph_inputs = []

    def recording_backend(gm, example_inputs):
        graph_inputs.append(example_inputs)
        return gm.forward

    config = CompileConfig(fullgraph=True, backend=recording_backend, mode=None)
    config._compile_all_devices = True  # transformers only auto-compiles on accelerators
    with torch.no_grad():
        out = model.generate(
            ids, attention_mask=mask, **_compat.cache_kwargs(cache), max_new_tokens=40, do_sample=False,
            compile_config=config,
        )
    assert torch.equal(out, ref)
    assert counters["stats"]["unique_graphs"] <= 2, dict(counters["stats"])
    assert not counters["graph_break"], dict(counters["graph_break"])
    # the decode graph is fully static: no symbolic sizes or ints among its inputs (CUDA graphs
    # replay it as recorded; nothing recompiles as the sequences grow)
    assert len(graph_inputs) == 1
    assert all(isinstance(x, torch.Tensor) for x in graph_inputs[0]), [type(x) for x in graph_inputs[0]]
