"""transformers end to end: Qwen3 generate() on a PagedKVCache against transformers' sdpa.

Tiny random Qwen3 models built offline (``minipaged_ops.tiny``: seeded, weights scaled up so that
greedy choices are not near-ties). float32 outputs must be equal; bfloat16 ones equal up to
near-ties (``compare_greedy``). Runs on the CPU kernels; also under transformers 5.17 via
``make test`` (``PYTHONPATH=.venv/transformers-5.17.0``).
"""

from __future__ import annotations

import functools
import math
import subprocess
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")
integration = pytest.importorskip("minipaged_ops.integration")

from transformers import DynamicCache, Qwen3Config, Qwen3ForCausalLM  # noqa: E402

import minipaged_ops  # noqa: E402
from minipaged_ops import tiny  # noqa: E402
from minipaged_ops.integration import OutOfBlocksError, PagedKVCache, _compat  # noqa: E402

VOCAB = 192
PAD = tiny.PAD
# every test runs with deprecation warnings as errors: the cache goes in under the name the
# installed release wants (`cache=` from 5.24 on, `past_key_values=` before)
pytestmark = pytest.mark.filterwarnings("error::FutureWarning")


@functools.lru_cache(maxsize=None)
def tiny_model(heads: int = 4, kv_heads: int = 2, head_dim: int = 64, hidden: int = 64, seed: int = 0,
               dtype: torch.dtype = torch.float32):
    return tiny.tiny_model("qwen3", heads=heads, kv_heads=kv_heads, head_dim=head_dim, hidden=hidden, vocab=VOCAB,
                           seed=seed, dtype=dtype)


def ragged_batch(lengths, seed=0, width=None):
    return tiny.ragged_batch(lengths, VOCAB, seed=seed, width=width)


def generate(model, impl, ids, mask, cache=None, seed=0, **kwargs):
    model.set_attn_implementation(impl)
    torch.manual_seed(seed)
    extra = {} if cache is None else _compat.cache_kwargs(cache)
    with torch.no_grad():
        return model.generate(ids, attention_mask=mask, pad_token_id=PAD, **extra, **kwargs)


def assert_same_greedy(model, ids, mask, ref, out):
    """float32: equal; bfloat16/float16: equal up to near-ties (``ref``/``out`` are generate's
    dict outputs with logits)."""
    if model.dtype == torch.float32:
        assert torch.equal(out.sequences, ref.sequences)
        return
    width = ids.shape[1]
    matches = tiny.compare_greedy(ref.sequences[:, width:], torch.stack(ref.logits, 1),
                                  out.sequences[:, width:], torch.stack(out.logits, 1))
    assert all(m.close for m in matches), matches


def blocks_bound(cache: PagedKVCache) -> int:
    """Σ ceil(tokens_i / block_size) over the live sequences."""
    bm = cache.block_manager
    return sum(math.ceil(bm.sequence_length(s) / cache.block_size) for s in cache.sequence_ids)


def check_memory(cache: PagedKVCache):
    u = cache.usage()
    assert cache.block_manager.invariants_ok(), cache.block_manager.invariant_violations()
    assert u["blocks_used"] <= blocks_bound(cache), u
    return u


# ---------------------------------------------------------------------------- equality


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize(
    "heads,kv_heads,head_dim,block_size",
    [(4, 2, 64, 8), (4, 1, 128, 16), (2, 2, 64, 32), (8, 2, 128, 8)],
    ids=["gqa2-d64-bs8", "gqa4-d128-bs16", "mha-d64-bs32", "gqa4-d128-bs8"],
)
def test_greedy_ragged_batch_matches_sdpa(heads, kv_heads, head_dim, block_size, dtype):
    model = tiny_model(heads, kv_heads, head_dim, dtype=dtype)
    ids, mask = ragged_batch([13, 5, 21, 1], seed=heads + head_dim)
    kwargs = dict(max_new_tokens=24, do_sample=False, return_dict_in_generate=True, output_logits=True)
    ref = generate(model, "sdpa", ids, mask, **kwargs)
    cache = PagedKVCache(model, num_blocks=64, block_size=block_size)
    out = generate(model, "minipaged", ids, mask, cache, **kwargs)
    assert_same_greedy(model, ids, mask, ref, out)
    assert cache.key_cache[0].dtype == dtype
    u = check_memory(cache)
    # the cache holds prompt + generated - 1 tokens per row, pads never
    lengths = [cache.block_manager.sequence_length(s) for s in cache.sequence_ids]
    assert lengths == [n + 23 for n in (13, 5, 21, 1)]
    assert u["tokens_logical"] == sum(lengths)


def test_sampling_num_return_sequences_shares_prompt_blocks():
    model = tiny_model()
    bs = 8
    ids, mask = ragged_batch([19, 11], seed=3)
    kwargs = dict(max_new_tokens=16, do_sample=True, top_k=0, temperature=1.0, num_return_sequences=4)
    ref = generate(model, "sdpa", ids, mask, seed=1234, **kwargs)
    cache = PagedKVCache(model, num_blocks=64, block_size=bs)
    out = generate(model, "minipaged", ids, mask, cache, seed=1234, **kwargs)
    assert torch.equal(out, ref)
    assert len({tuple(r) for r in out[:4].tolist()}) > 1  # the samples do diverge
    u = check_memory(cache)
    bm = cache.block_manager
    rows = cache.sequence_ids
    for group, prompt_len in ((rows[:4], 19), (rows[4:], 11)):
        tables = [bm.block_table(s) for s in group]
        full = prompt_len // bs
        for j in range(full):  # the prompt's full blocks are stored once, shared by all 4
            assert len({t[j] for t in tables}) == 1
            assert bm.ref_count(tables[0][j]) == 4
    unshared = sum(4 * math.ceil((n + 15) / bs) for n in (19, 11))
    assert u["blocks_used"] <= unshared - 3 * (19 // bs + 11 // bs)


def test_beam_search_matches_sdpa_with_shared_blocks():
    model = tiny_model(4, 1, 128)
    ids, mask = ragged_batch([9, 17], seed=5)
    kwargs = dict(max_new_tokens=12, do_sample=False, num_beams=3, num_return_sequences=2, length_penalty=1.0)
    ref = generate(model, "sdpa", ids, mask, **kwargs)
    cache = PagedKVCache(model, num_blocks=64, block_size=8)
    out = generate(model, "minipaged", ids, mask, cache, **kwargs)
    assert torch.equal(out, ref)
    check_memory(cache)
    assert len(cache.sequence_ids) == 6
    assert cache.usage()["blocks_shared"] >= 2  # beams share their common prefix blocks


@pytest.fixture
def prefill_calls(monkeypatch) -> list:
    """One entry per call of the paged prefill attention op (once per layer per step)."""
    calls = []
    original = minipaged_ops.paged_attention_prefill
    monkeypatch.setattr(minipaged_ops, "paged_attention_prefill", lambda *a, **k: calls.append(1) or original(*a, **k))
    return calls


def test_unpadded_prompts_prefill_through_the_planner_with_prefix_hits_and_repeats(prefill_calls):
    # Prompts of one length (no padding) are prefilled as the engine's chunks: packed attention
    # over the paged cache; a repeated prompt and a prefix hit are read from the shared blocks,
    # never rewritten (a second write of a slot is rejected by reshape_and_cache).
    model = tiny_model()
    ids, mask = ragged_batch([21, 21], seed=17)
    kwargs = dict(max_new_tokens=9, do_sample=True, top_k=0, temperature=1.0, num_return_sequences=3)
    ref = generate(model, "sdpa", ids, mask, seed=99, **kwargs)
    cache = PagedKVCache(model, num_blocks=64, block_size=8, enable_prefix_caching=True)
    out = generate(model, "minipaged", ids, mask, cache, seed=99, **kwargs)
    assert torch.equal(out, ref)
    assert len(prefill_calls) == model.config.num_hidden_layers  # the prompts' one step
    check_memory(cache)
    cache.reset()
    out = generate(model, "minipaged", ids, mask, cache, seed=99, **kwargs)  # 2 full blocks each are hits
    assert torch.equal(out, ref)
    assert cache.usage()["blocks_shared"] >= 2
    check_memory(cache)


def test_chat_turn_continuation_reuses_prefix(prefill_calls):
    # The new turn attends to its paged history through the prefill path (no gather + SDPA).
    model = tiny_model()
    ids, mask = ragged_batch([10, 6], seed=7)
    cache = PagedKVCache(model, num_blocks=64, block_size=8)
    out1 = generate(model, "minipaged", ids, mask, cache, max_new_tokens=8, do_sample=False)
    dyn = DynamicCache(config=model.config)
    ref1 = generate(model, "sdpa", ids, mask, dyn, max_new_tokens=8, do_sample=False)
    assert torch.equal(out1, ref1)

    g = torch.Generator().manual_seed(8)
    turn = torch.randint(3, VOCAB, (2, 5), generator=g)
    ids2 = torch.cat([out1, turn], 1)
    mask2 = torch.cat([mask, torch.ones(2, out1.shape[1] - mask.shape[1] + 5, dtype=torch.long)], 1)
    blocks_before = {s: cache.block_manager.block_table(s) for s in cache.sequence_ids}

    prefill_calls.clear()  # the first turn's prompts went through it too
    seen = []
    handle = model.register_forward_pre_hook(lambda m, a, k: seen.append(k["input_ids"].shape[1]), with_kwargs=True)
    try:
        out2 = generate(model, "minipaged", ids2, mask2, cache, max_new_tokens=8, do_sample=False)
    finally:
        handle.remove()
    ref2 = generate(model, "sdpa", ids2, mask2, dyn, max_new_tokens=8, do_sample=False)
    fresh = generate(model, "sdpa", ids2, mask2, max_new_tokens=8, do_sample=False)
    assert torch.equal(out2, ref2)
    assert torch.equal(out2, fresh)
    assert seen[0] == 1 + 5  # only the last generated token and the new turn were computed
    assert len(prefill_calls) == model.config.num_hidden_layers  # the turn's step, once per layer
    for s, before in blocks_before.items():  # the first turn's full blocks are still the ones in use
        after = cache.block_manager.block_table(s)
        n_full = (cache.block_manager.sequence_length(s) - 1 - 5 - 7) // 8
        assert after[:n_full] == before[:n_full]
    check_memory(cache)


def test_reset_frees_everything_and_reuse_hits_prefix_cache():
    model = tiny_model()
    ids, mask = ragged_batch([20, 12, 17], seed=9)
    cache = PagedKVCache(model, num_blocks=48, block_size=8, enable_prefix_caching=True)
    ref = generate(model, "sdpa", ids, mask, max_new_tokens=10, do_sample=False)
    out = generate(model, "minipaged", ids, mask, cache, max_new_tokens=10, do_sample=False)
    assert torch.equal(out, ref)
    first_tables = [cache.block_manager.block_table(s) for s in cache.sequence_ids]
    cache.reset()
    u = cache.usage()
    assert u["blocks_used"] == 0 and u["blocks_free"] == cache.num_blocks and u["sequences"] == 0
    assert u["blocks_cached_free"] > 0  # full prompt blocks remain findable
    assert cache.get_seq_length() == 0
    out = generate(model, "minipaged", ids, mask, cache, max_new_tokens=10, do_sample=False)
    assert torch.equal(out, ref)
    # each prompt's full blocks (20, 12, 17 tokens in blocks of 8: 2, 1, 2) were found again, the
    # very blocks of the first run, each held by its one sequence
    tables = [cache.block_manager.block_table(s) for s in cache.sequence_ids]
    for before, after, full in zip(first_tables, tables, (2, 1, 2)):
        assert after[:full] == before[:full]
        assert [cache.block_manager.ref_count(b) for b in after] == [1] * len(after)
    check_memory(cache)
    # a different batch after reset
    cache.reset()
    ids2, mask2 = ragged_batch([4, 9], seed=10)
    ref2 = generate(model, "sdpa", ids2, mask2, max_new_tokens=6, do_sample=False)
    assert torch.equal(generate(model, "minipaged", ids2, mask2, cache, max_new_tokens=6, do_sample=False), ref2)


def test_model_built_with_minipaged_and_cache_from_model():
    model = tiny_model()
    ids, mask = ragged_batch([7, 3], seed=11)
    ref = generate(model, "sdpa", ids, mask, max_new_tokens=6, do_sample=False)
    cache = PagedKVCache(model, num_blocks=16, block_size=16)  # attaches at once, pools allocated
    assert len(cache.key_cache) == model.config.num_hidden_layers
    assert tuple(cache.key_cache[0].shape) == (16, 2, 16, 64)
    assert torch.equal(generate(model, "minipaged", ids, mask, cache, max_new_tokens=6, do_sample=False), ref)


# --------------------------------------------------------------------- no paged cache


def test_fallback_without_paged_cache_is_sdpa():
    model = tiny_model(4, 1, 128)
    ids, mask = ragged_batch([8, 5, 2], seed=12)
    with torch.no_grad():
        model.set_attn_implementation("sdpa")
        ref_logits = model(ids, attention_mask=mask, use_cache=False).logits
        model.set_attn_implementation("minipaged")
        logits = model(ids, attention_mask=mask, use_cache=False).logits
        plain = model(ids, attention_mask=mask).logits  # default DynamicCache
    torch.testing.assert_close(logits, ref_logits, rtol=0, atol=0)
    torch.testing.assert_close(plain, ref_logits, rtol=0, atol=0)
    ref = generate(model, "sdpa", ids, mask, max_new_tokens=8, do_sample=False)
    assert torch.equal(generate(model, "minipaged", ids, mask, max_new_tokens=8, do_sample=False), ref)
    dyn = DynamicCache(config=model.config)
    assert torch.equal(generate(model, "minipaged", ids, mask, dyn, max_new_tokens=8, do_sample=False), ref)
    static = generate(model, "minipaged", ids, mask, max_new_tokens=8, do_sample=False, cache_implementation="static")
    assert torch.equal(static, generate(model, "sdpa", ids, mask, max_new_tokens=8, do_sample=False,
                                        cache_implementation="static"))


def test_manual_decode_loop_with_plain_forward():
    model = tiny_model()
    model.set_attn_implementation("minipaged")
    ids, _ = ragged_batch([6, 6], seed=13)
    cache = PagedKVCache(model, num_blocks=16, block_size=8)
    with torch.no_grad():
        logits = model(ids, **_compat.cache_kwargs(cache), use_cache=True).logits[:, -1]
        seq = ids
        for _ in range(5):
            nxt = logits.argmax(-1, keepdim=True)
            seq = torch.cat([seq, nxt], 1)
            logits = model(nxt, **_compat.cache_kwargs(cache), use_cache=True).logits[:, -1]
        model.set_attn_implementation("sdpa")
        ref_logits = model(seq).logits[:, -1]
    assert cache.get_seq_length() == seq.shape[1]
    torch.testing.assert_close(logits, ref_logits, rtol=1e-4, atol=1e-4)


# ------------------------------------------------------------------------------ errors


def test_pool_too_small_raises_out_of_blocks():
    model = tiny_model()
    ids, mask = ragged_batch([30, 30], seed=14)
    cache = PagedKVCache(model, num_blocks=5, block_size=8)
    with pytest.raises(OutOfBlocksError, match=r"needs .*8 blocks.* 5 of 5 are free"):
        generate(model, "minipaged", ids, mask, cache, max_new_tokens=4, do_sample=False)
    assert cache.block_manager.num_free_blocks == 5 and cache.block_manager.invariants_ok()
    # room for the prompt but not for the generation: fails during decode and leaves the cache
    # clean (the dead batch released), so the next generate just works
    cache = PagedKVCache(model, num_blocks=8, block_size=8)
    with pytest.raises(OutOfBlocksError, match="the cache was reset") as info:
        generate(model, "minipaged", ids, mask, cache, max_new_tokens=8, do_sample=False)
    assert info.value.needed > info.value.free
    assert cache.block_manager.invariants_ok()
    assert cache.block_manager.num_free_blocks == 8 and cache.sequence_ids == [] and cache.get_seq_length() == 0
    small, small_mask = ragged_batch([9, 3], seed=16)
    ref = generate(model, "sdpa", small, small_mask, max_new_tokens=6, do_sample=False)
    assert torch.equal(generate(model, "minipaged", small, small_mask, cache, max_new_tokens=6, do_sample=False), ref)


def test_sliding_window_config_is_rejected_when_building_the_cache():
    cfg = tiny_model().config.to_dict()
    cfg.update(use_sliding_window=True, sliding_window=16, max_window_layers=1, layer_types=None)
    config = Qwen3Config(**cfg)
    assert "sliding_attention" in config.layer_types
    with pytest.raises(ValueError, match="sliding_attention"):
        PagedKVCache(config, num_blocks=8, block_size=8)


def test_bad_arguments_and_misuse():
    model = tiny_model()
    with pytest.raises(ValueError, match="num_blocks"):
        PagedKVCache(model, num_blocks=0)
    with pytest.raises(ValueError, match="block_size"):
        PagedKVCache(model, num_blocks=4, block_size=0)
    ids, mask = ragged_batch([4, 4], seed=15)
    cache = PagedKVCache(model, num_blocks=16, block_size=8)
    with pytest.raises(ValueError, match="attn_implementation"):
        generate(model, "sdpa", ids, mask, cache, max_new_tokens=2)
    generate(model, "minipaged", ids, mask, cache, max_new_tokens=2)
    ids3, mask3 = ragged_batch([4, 4, 4], seed=15)
    with pytest.raises(ValueError, match="reset"):
        generate(model, "minipaged", ids3, mask3, cache, max_new_tokens=2)


def test_cache_dtype_differing_from_the_model_is_a_clear_error():
    model = tiny_model()
    ids, mask = ragged_batch([4, 6], seed=17)
    cache = PagedKVCache(model.config, num_blocks=16, block_size=8, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"cache holds bfloat16 but the model computes in float32"):
        cache.attach(model)
    assert cache.block_manager.num_free_blocks == 16 and cache.pool is None
    with pytest.raises(ValueError, match=r"cache holds float16 but the model computes in float32"):
        PagedKVCache(model, num_blocks=16, block_size=8, dtype=torch.float16)


def test_cache_binds_through_a_compile_wrapper_made_first():
    model = tiny_model(seed=21)  # a model of its own config: no other live model shares it
    compiled = torch.compile(model, backend="eager")  # a wrapper exposing the same config
    ids, mask = ragged_batch([7, 12], seed=18)
    ref = generate(model, "sdpa", ids, mask, max_new_tokens=6, do_sample=False)
    for cache in (PagedKVCache(model.config, num_blocks=16, block_size=8).attach(compiled),
                  PagedKVCache(compiled, num_blocks=16, block_size=8)):
        assert torch.equal(generate(compiled, "minipaged", ids, mask, cache, max_new_tokens=6, do_sample=False), ref)
    assert getattr(compiled, "_minipaged_hooks", None) is model._minipaged_hooks  # hooks on the model itself


class _PeftLikeWrapper(torch.nn.Module):
    """What the cache needs of a PEFT model: ``get_base_model()`` and the wrapped model's config."""

    def __init__(self, model):
        super().__init__()
        self.base_model = model

    def get_base_model(self):
        return self.base_model

    @property
    def config(self):
        return self.base_model.config


def test_a_config_only_cache_binds_only_the_model_it_is_given():
    config = tiny.tiny_config("qwen3", vocab=VOCAB)
    first, second = Qwen3ForCausalLM(config).eval(), Qwen3ForCausalLM(config).eval()  # one config object
    ids, mask = ragged_batch([5, 9], seed=19)
    ref = generate(second, "sdpa", ids, mask, max_new_tokens=5, do_sample=False)
    cache = PagedKVCache(first.config, num_blocks=16, block_size=8)  # two live models share it: bound to none
    with pytest.raises(RuntimeError, match=r"cannot tell which model .*attach\(model\)"):
        generate(second, "minipaged", ids, mask, cache, max_new_tokens=5, do_sample=False)
    cache.attach(_PeftLikeWrapper(second))  # unwrapped, bound to `second`
    assert torch.equal(generate(second, "minipaged", ids, mask, cache, max_new_tokens=5, do_sample=False), ref)
    assert getattr(first, "_minipaged_hooks", None) is None  # the unrelated model was not touched
    first_cache = PagedKVCache(first, num_blocks=16, block_size=8)
    with pytest.raises(RuntimeError, match="not attached"), torch.no_grad():
        second(ids, **_compat.cache_kwargs(first_cache))  # `second` is hooked, but bound to another cache
    # a config-only cache does bind a model that another cache hooked, if built from its config object
    late = PagedKVCache(first.config, num_blocks=16, block_size=8)
    ref_first = generate(first, "sdpa", ids, mask, max_new_tokens=5, do_sample=False)
    assert torch.equal(generate(first, "minipaged", ids, mask, late, max_new_tokens=5, do_sample=False), ref_first)


def test_layers_hold_the_pools_however_the_cache_binds():
    # transformers reads a layer's keys/values and device: the cache points them at its pools when
    # it makes them, at construction from the model, at attach, or at a first forward that binds
    model = tiny_model()
    ids, mask = ragged_batch([5, 9], seed=20)
    PagedKVCache(model, num_blocks=16, block_size=8)  # hooks the model
    bound_at_forward = PagedKVCache(model.config, num_blocks=16, block_size=8)
    assert bound_at_forward.pool is None and not any(layer.is_initialized for layer in bound_at_forward.layers)
    generate(model, "minipaged", ids, mask, bound_at_forward, max_new_tokens=2, do_sample=False)
    for cache in (PagedKVCache(model, num_blocks=16, block_size=8),
                  PagedKVCache(model.config, num_blocks=16, block_size=8).attach(model), bound_at_forward):
        assert len(cache.layers) == model.config.num_hidden_layers == len(cache.pool.kv_caches)
        for layer, (keys, values) in zip(cache.layers, cache.pool.kv_caches):
            assert layer.keys is keys and layer.values is values and layer.is_initialized
            assert layer.device == cache.pool.device


def test_unattached_model_raises_clear_error():
    model = tiny_model()
    other = Qwen3ForCausalLM(model.config.__class__(**model.config.to_dict())).eval()
    other.set_attn_implementation("minipaged")
    cache = PagedKVCache(model, num_blocks=8, block_size=8)  # attaches to `model`, not `other`
    with pytest.raises(RuntimeError, match="attach"), torch.no_grad():
        other(torch.tensor([[5, 6, 7]]), **_compat.cache_kwargs(cache))


def test_registration_is_idempotent_and_import_is_lazy():
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    integration.register()
    integration.register()
    assert ALL_ATTENTION_FUNCTIONS["minipaged"] is integration.minipaged_attention_forward
    assert ALL_MASK_ATTENTION_FUNCTIONS["minipaged"] is integration.minipaged_mask
    code = "import sys, minipaged_ops; assert 'transformers' not in sys.modules, 'transformers imported'"
    subprocess.run([sys.executable, "-c", code], check=True)
