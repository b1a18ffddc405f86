"""The "minipaged" attention and mask functions registered in transformers' interfaces.

With a :class:`~.cache.PagedKVCache` (the forward pre-hook passes it as ``minipaged_cache``):
decode steps attend with ``paged_attention_decode`` straight from the block pools; prefill steps
use SDPA over the new tokens (and the gathered cached prefix when a conversation continues), with
transformers' own mask. Without one (plain forward, ``use_cache=False``, another cache class) it
is transformers' SDPA attention, so it is always correct.
"""

from __future__ import annotations

import torch

import minipaged_ops

from . import _compat
from .step import StepMetadata, packed_attention


def minipaged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    minipaged_cache=None,
    minipaged_step: StepMetadata | None = None,
    minipaged_kv_caches=None,
    **kwargs,
):
    """``query`` is ``[batch, heads, q_len, head_dim]``; returns ``([batch, q_len, heads, head_dim], None)``.

    ``minipaged_step`` (with ``minipaged_kv_caches``, one ``(key_cache, value_cache)`` per layer)
    is the engine's packed step: batch 1, every scheduled token in one row."""
    if minipaged_step is not None:
        key_cache, value_cache = minipaged_kv_caches[module.layer_idx]
        out = packed_attention(
            query[0].transpose(0, 1).contiguous(),
            key[0].transpose(0, 1).contiguous(),
            value[0].transpose(0, 1).contiguous(),
            key_cache, value_cache, minipaged_step,
            query.shape[-1] ** -0.5 if scaling is None else scaling,
        )
        return out.unsqueeze(0), None
    if minipaged_cache is None or minipaged_cache._mode != "decode":
        return _compat.sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    out = minipaged_ops.paged_attention_decode(
        query[:, :, 0, :],
        key,  # the layer's key pool, returned by PagedKVCache.update
        value,
        minipaged_cache._block_tables,
        minipaged_cache._seq_lens,
        scaling,
    )
    return out.unsqueeze(1), None


def minipaged_mask(*args, **kwargs):
    """Mask function: the same boolean masks as transformers' ``sdpa`` (what the SDPA paths above
    consume). Decode steps on a paged cache ignore the mask: pad tokens were never stored, and
    ``seq_lens`` bounds what each sequence reads."""
    return _compat.sdpa_mask(*args, **kwargs)
