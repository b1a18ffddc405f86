"""transformers' assisted generation on a PagedKVCache (its ``crop``): prompt lookup and an
assistant model, eager and compiled, give the tokens of sdpa in float32; rejected candidates'
blocks go back to the pool; a crop of a left-padded batch keeps each row's own real tokens."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("minipaged_ops.integration")

import torch._dynamo  # noqa: E402

from minipaged_ops.integration import PagedKVCache, _compat  # noqa: E402
from minipaged_ops.tiny import PAD, tiny_model  # noqa: E402

pytestmark = pytest.mark.filterwarnings("error::FutureWarning")
VOCAB = 160


def model_of(seed, layers=2):
    return tiny_model("qwen3", vocab=VOCAB, max_positions=256, seed=seed, layers=layers)


def repetitive_prompt(seed, length=40):
    """A prompt made of a few repeated phrases, so that prompt lookup finds candidates."""
    g = torch.Generator().manual_seed(seed)
    phrases = [torch.randint(3, VOCAB, (5,), generator=g) for _ in range(3)]
    order = torch.randint(0, 3, (length // 5,), generator=g).tolist()
    return torch.cat([phrases[i] for i in order]).unsqueeze(0)


def generate(model, impl, ids, cache=None, **kwargs):
    model.set_attn_implementation(impl)
    extra = {} if cache is None else _compat.cache_kwargs(cache)
    with torch.no_grad():
        return model.generate(ids, attention_mask=torch.ones_like(ids), pad_token_id=PAD, do_sample=False,
                              max_new_tokens=48, **extra, **kwargs)


class CropCounter:
    """Counts the columns a cache's crops removed (assisted generation must have rejected some,
    or the test proves nothing about the rollback)."""

    def __init__(self, cache):
        self.removed, self._crop = 0, cache.crop
        cache.crop = self

    def __call__(self, n):
        self.removed += -n if n < 0 else 0
        self._crop(n)


def check_all_blocks_free(cache):
    bm = cache.block_manager
    assert bm.invariants_ok(), bm.invariant_violations()
    cache.reset()
    assert bm.num_free_blocks == bm.num_blocks and bm.usage()["blocks_used"] == 0


@pytest.mark.parametrize("assist", ["prompt_lookup", "assistant_model"])
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_assisted_generation_on_the_paged_cache_gives_the_tokens_of_sdpa(assist, compiled):
    torch._dynamo.reset()
    model = model_of(seed=3)
    ids = repetitive_prompt(seed=3)
    if assist == "prompt_lookup":
        kwargs = dict(prompt_lookup_num_tokens=4)
    else:
        assistant = model_of(seed=4, layers=1)
        assistant.set_attn_implementation("sdpa")
        kwargs = dict(assistant_model=assistant)
    plain = generate(model, "sdpa", ids)
    ref = generate(model, "sdpa", ids, **kwargs)
    assert torch.equal(ref, plain)  # greedy assisted generation is greedy generation
    cache = PagedKVCache(model, num_blocks=32, block_size=4, dtype=torch.float32, device="cpu")
    crops = CropCounter(cache)
    forward = model.forward
    if compiled:
        # dynamo traces the whole forward (no graph break) for every candidate length; aot_eager
        # keeps the test quick (test_integration_compile runs inductor)
        model.forward = torch.compile(forward, fullgraph=True, dynamic=True, backend="aot_eager")
    try:
        out = generate(model, "minipaged", ids, cache, **kwargs)
    finally:
        model.forward = forward
    assert torch.equal(out, ref)
    assert crops.removed > 0, "no candidate was rejected: the rollback went untested"
    check_all_blocks_free(cache)
    torch._dynamo.reset()


def test_crop_of_a_left_padded_batch_keeps_each_rows_real_tokens_and_recomputes_the_same_logits():
    model = model_of(seed=5)
    model.set_attn_implementation("minipaged")
    g = torch.Generator().manual_seed(5)
    prompt = torch.randint(3, VOCAB, (2, 9), generator=g)
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[1, :4] = 0  # row 1: 4 padding columns, 5 real tokens
    prompt[mask == 0] = PAD
    more = torch.randint(3, VOCAB, (2, 5), generator=g)
    cache = PagedKVCache(model, num_blocks=16, block_size=4, dtype=torch.float32, device="cpu",
                         enable_prefix_caching=True)
    full = torch.cat([mask, torch.ones(2, 5, dtype=torch.long)], 1)
    with torch.no_grad():
        model(prompt, attention_mask=mask, **_compat.cache_kwargs(cache))
        first = model(more, attention_mask=full, **_compat.cache_kwargs(cache)).logits
        bm, rows = cache.block_manager, cache.sequence_ids
        assert [bm.sequence_length(s) for s in rows] == [14, 10]
        cache.crop(-3)  # the last 3 of the 5 new columns are taken back
        assert cache.get_seq_length() == 11 and [bm.sequence_length(s) for s in rows] == [11, 7]
        # the same 3 tokens again, now over a cache that forgot them: the same logits
        again = model(more[:, 2:], attention_mask=full, **_compat.cache_kwargs(cache)).logits
    torch.testing.assert_close(again, first[:, 2:], rtol=0, atol=1e-5)
    cache.crop(2)  # the older meaning: keep 2 columns, both padding in row 1
    assert cache.get_seq_length() == 2 and [bm.sequence_length(s) for s in rows] == [2, 0]
    for bad, err in ((1.5, TypeError), (True, TypeError), (-3, ValueError)):
        with pytest.raises(err, match="crop"):
            cache.crop(bad)
    assert cache.get_seq_length() == 2
    check_all_blocks_free(cache)
