"""The shared tiny-model builder (``minipaged_ops.tiny``): every architecture it builds runs on a
PagedKVCache with sdpa's tokens; and the low-precision comparison rule accepts near-ties only."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("minipaged_ops.integration")

from minipaged_ops.integration import PagedKVCache, _compat  # noqa: E402
from minipaged_ops.tiny import ARCHITECTURES, compare_greedy, ragged_batch, tiny_model  # noqa: E402

pytestmark = pytest.mark.filterwarnings("error::FutureWarning")


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_every_architecture_generates_sdpa_tokens_on_the_paged_cache(arch):
    model = tiny_model(arch, heads=4, kv_heads=2, head_dim=32, seed=1)
    assert type(model).__name__.lower().startswith(arch)
    ids, mask = ragged_batch([9, 4, 13], vocab=model.config.vocab_size, seed=1)
    gen = dict(attention_mask=mask, max_new_tokens=10, do_sample=False)
    with torch.no_grad():
        model.set_attn_implementation("sdpa")
        ref = model.generate(ids, **gen)
        model.set_attn_implementation("minipaged")
        cache = PagedKVCache(model, num_blocks=32, block_size=8)
        out = model.generate(ids, **gen, **_compat.cache_kwargs(cache))
    assert torch.equal(out, ref)
    assert cache.usage()["tokens_logical"] == 9 + 4 + 13 + 3 * 9


def _logits(rows):
    """[batch, steps, vocab=6] logits whose ranking per step is given (best first)."""
    out = torch.zeros(len(rows), len(rows[0]), 6)
    for b, steps in enumerate(rows):
        for t, ranking in enumerate(steps):
            for rank, token in enumerate(ranking):
                out[b, t, token] = 10.0 - rank
    return out


def test_compare_greedy_accepts_a_near_tie_and_nothing_else():
    ref_tokens = torch.tensor([[1, 2, 3], [1, 2, 3], [1, 2, 3]])
    out_tokens = torch.tensor([[1, 2, 3], [1, 4, 0], [5, 2, 3]])
    ref_logits = _logits([[[1, 0], [2, 4], [3]], [[1], [2, 4], [3]], [[1, 0], [2], [3]]])
    out_logits = _logits([[[1, 0], [2, 4], [3]], [[1], [4, 2], [0]], [[5, 0], [2], [3]]])
    top2 = compare_greedy(ref_tokens, ref_logits, out_tokens, out_logits, top_k=2)
    assert [(m.first_difference, m.close) for m in top2] == [(None, True), (1, True), (0, False)]
    # the flip at step 1 of row 1 is within each other's top-2 but not top-1; what follows is not compared
    top1 = compare_greedy(ref_tokens, ref_logits, out_tokens, out_logits, top_k=1)
    assert [m.close for m in top1] == [True, False, False]
