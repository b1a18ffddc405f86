"""The in-layer side of a step: the "minipaged" attention and mask functions registered in
transformers' interfaces, and the packed attention they run.

The attention reads one thing: the step's frozen :class:`~.planner.StepMetadata`, made by the
planner (``plan_step``) and passed down by the caller as ``minipaged_step``: the engine for every
packed step, :class:`~.cache.PagedKVCache`'s forward hook for every step of ``generate()``.
Without it (a plain forward, ``use_cache=False``, another cache class) it is transformers' SDPA
attention, so it is always correct.
"""

from __future__ import annotations

import torch

import minipaged_ops

from . import _compat
from .planner import StepMetadata

ATTN_IMPLEMENTATION = "minipaged"


def minipaged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    minipaged_step: StepMetadata | None = None,
    minipaged_kv_caches=None,
    minipaged_kv_scales=None,
    **kwargs,
):
    """``query`` is ``[batch, heads, q_len, head_dim]``, ``key``/``value`` this step's
    ``[batch, kv_heads, q_len, head_dim]``; returns ``([batch, q_len, heads, head_dim], None)``.

    With ``minipaged_step`` (and ``minipaged_kv_caches``, one ``(key_cache, value_cache)`` per
    layer) the batch's ``batch * q_len`` tokens are the step's packed tokens, in order: the
    engine's packed step (batch 1) or a ``PagedKVCache`` decode step (``q_len`` 1). Without it,
    transformers' SDPA on what the cache returned."""
    if minipaged_step is None:
        return _compat.sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    batch, heads, q_len, head_dim = query.shape
    key_cache, value_cache = minipaged_kv_caches[module.layer_idx]
    # An 8-bit pool's scales (kv_pool.LayerScales); fp8 ones asked to be calculated are set from
    # the first batch this layer writes.
    scales = None if minipaged_kv_scales is None else minipaged_kv_scales[module.layer_idx]
    index = minipaged_step.token_index
    def packed(t):
        t = t.transpose(1, 2).reshape(batch * q_len, t.shape[1], head_dim)
        return t if index is None else t.index_select(0, index)  # padding columns dropped
    key, value = packed(key), packed(value)
    if scales is not None and scales.pending:
        scales.calibrate(key, value, key_cache.dtype)
    out = packed_attention(
        packed(query), key, value, key_cache, value_cache, minipaged_step,
        head_dim ** -0.5 if scaling is None else scaling,
        *((scales.key, scales.value) if scales is not None else ()),
    )
    if index is not None:  # padding columns get zeros (transformers masks them out downstream)
        out = out.new_zeros(batch * q_len, heads, head_dim).index_copy_(0, index, out)
    return out.view(batch, q_len, heads, head_dim), None


def minipaged_mask(*args, **kwargs):
    """Mask function: the same boolean masks as transformers' ``sdpa`` (what the SDPA paths above
    consume). Decode steps on a paged cache ignore the mask: pad tokens were never stored, and
    ``seq_lens`` bounds what each sequence reads."""
    return _compat.sdpa_mask(*args, **kwargs)


def packed_attention(query, key, value, key_cache, value_cache, meta: StepMetadata, scale: float,
                     key_scale=None, value_scale=None) -> torch.Tensor:
    """Attention of one layer for a packed step.

    ``query`` ``[total_tokens, num_heads, head_dim]``, ``key``/``value`` ``[total_tokens,
    num_kv_heads, head_dim]`` (this step's tokens). Writes the new K/V into the pools first, so
    every chunk (and every other chunk reading a block this step fills) sees them; then decodes
    read their history with ``paged_attention_decode`` and prefill chunks attend causally to their
    paged history and themselves with ``paged_attention_prefill``. Returns ``[total_tokens,
    num_heads, head_dim]``. An 8-bit pool takes its scales (``key_scale``, ``value_scale``)."""
    minipaged_ops.reshape_and_cache(key, value, key_cache, value_cache, meta.slot_mapping, key_scale, value_scale)
    scales = dict(key_scale=key_scale, value_scale=value_scale)
    nd = meta.num_decodes
    if nd == len(meta.query_lens):
        return minipaged_ops.paged_attention_decode(
            query, key_cache, value_cache, meta.block_tables, meta.seq_lens, scale, **scales)
    out = query.new_empty(query.shape)
    if nd:
        out[:nd] = minipaged_ops.paged_attention_decode(
            query[:nd].contiguous(), key_cache, value_cache, meta.block_tables[:nd], meta.seq_lens[:nd], scale,
            **scales)
    cu_seqlens_q = meta.query_start_loc[nd:] - meta.query_start_loc[nd]
    out[nd:] = minipaged_ops.paged_attention_prefill(
        query[nd:].contiguous(), key_cache, value_cache, meta.block_tables[nd:], cu_seqlens_q, meta.seq_lens[nd:],
        scale, max(meta.query_lens[nd:]), **scales)
    return out
