"""One forward step over many sequences packed into one row: the planner and the attention.

The planner turns the chunks a scheduler picked (for each sequence: the tokens computed this step
and where they start) into a frozen :class:`StepMetadata`, read by :func:`packed_attention` in
every layer. A generate() batch is the same thing: every sequence's prompt as one chunk, then one
token per sequence per decode step.

The caller's contract, per step (the block manager's, see ``minipaged_ops.block_manager``):

1. reserve the slots: ``create_sequence`` / ``append_tokens`` / ``append_token`` for every chunk;
2. perform ``block_manager.take_copies()`` on every layer's pools with ``copy_blocks``;
3. ``meta = plan_step(block_manager, chunks, device)``, then run the model with it.

Layout: the step's tokens are packed in chunk order, ``[total_tokens]``; chunks of one token
first (decodes: ``paged_attention_decode`` reads them straight from the pools), then prefill
chunks, which attend to their cached history plus themselves, causally.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Hashable, Optional, Sequence

import torch

import minipaged_ops

__all__ = ["ScheduledChunk", "StepMetadata", "packed_attention", "plan_step", "prefill_attention"]


# How prefill chunks attend: "auto" (the op when this build has it), "op", or "sdpa" (gather + SDPA).
PREFILL_BACKEND = "auto"


@dataclass(frozen=True)
class ScheduledChunk:
    """Tokens of one sequence computed in a step."""

    seq_id: Hashable  # the sequence's id in the block manager
    token_ids: Sequence[int]  # the tokens computed this step (their K/V get written)
    start: int  # position of the first of them = tokens of the sequence already in the cache
    sample: bool = True  # whether the step needs the logits of its last token
    # leading tokens whose K/V the cache already holds (a prefix hit that generate() recomputes
    # anyway): they get slot -1, so shared blocks are read but never rewritten
    cached: int = 0


@dataclass(frozen=True)
class StepMetadata:
    """Everything the layers read in one packed step. Tensors are on the model's device."""

    input_ids: torch.Tensor  # int64 [total_tokens]
    position_ids: torch.Tensor  # int64 [total_tokens]
    slot_mapping: torch.Tensor  # int64 [total_tokens]: where each token's K/V is written
    block_tables: torch.Tensor  # int32 [num_seqs, max_blocks]
    seq_lens: torch.Tensor  # int32 [num_seqs]: tokens each sequence holds once this step is written
    query_start_loc: torch.Tensor  # int32 [num_seqs + 1]: cu_seqlens_q, chunk i is rows [q[i], q[i+1])
    logits_indices: torch.Tensor  # int64 [num_sampled]: the rows whose logits are needed
    num_decodes: int  # chunks 0 .. num_decodes-1 are one token each
    query_lens: tuple[int, ...]  # host copies, so the prefill path needs no device sync
    context_lens: tuple[int, ...]  # = seq_lens on the host
    sampled: tuple[int, ...]  # chunk index of each row of logits_indices
    # int64 [total_tokens]: each token's row in the caller's [batch * q_len] layout, when that has
    # padding (a generate() prefill of ragged prompts); None: the same rows, in order
    token_index: Optional[torch.Tensor] = None

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def max_query_len(self) -> int:
        return max(self.query_lens, default=0)


def plan_step(block_manager, chunks: Sequence[ScheduledChunk], device=None) -> StepMetadata:
    """Build the step's metadata from chunks whose slots the block manager already holds."""
    if not chunks:
        raise ValueError("plan_step: no chunks to run")
    input_ids, positions, slots = [], [], []
    query_lens, context_lens, logits_rows, sampled = [], [], [], []
    num_decodes, in_decodes = 0, True
    for i, chunk in enumerate(chunks):
        n, end = len(chunk.token_ids), chunk.start + len(chunk.token_ids)
        if n == 0:
            raise ValueError(f"plan_step: chunk of sequence {chunk.seq_id!r} has no tokens")
        if not 0 <= chunk.cached <= n:
            raise ValueError(f"plan_step: chunk of sequence {chunk.seq_id!r} has cached={chunk.cached}, "
                             f"expected 0 .. {n} (its number of tokens)")
        held = block_manager.sequence_length(chunk.seq_id)
        if held != end:
            raise ValueError(f"plan_step: sequence {chunk.seq_id!r} holds {held} tokens but its chunk ends at {end}; "
                             "reserve the chunk's slots before planning")
        if in_decodes and n == 1:
            num_decodes += 1
        else:
            in_decodes = False
        input_ids.extend(chunk.token_ids)
        positions.extend(range(chunk.start, end))
        slots.extend([-1] * chunk.cached)
        slots.extend(block_manager.slot_mapping(chunk.seq_id, chunk.start + chunk.cached, end))
        query_lens.append(n)
        context_lens.append(end)
        if chunk.sample:
            logits_rows.append(len(input_ids) - 1)
            sampled.append(i)
    block_tables, seq_lens = block_manager.get_batch_tensors([c.seq_id for c in chunks])
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    host = torch.tensor([input_ids, positions, slots], dtype=torch.int64)
    return StepMetadata(
        input_ids=_to(host[0], device),
        position_ids=_to(host[1], device),
        slot_mapping=_to(host[2], device),
        block_tables=_to(block_tables, device),
        seq_lens=_to(seq_lens, device),
        query_start_loc=_to(torch.tensor(starts, dtype=torch.int32), device),
        logits_indices=_to(torch.tensor(logits_rows, dtype=torch.int64), device),
        num_decodes=num_decodes,
        query_lens=tuple(query_lens),
        context_lens=tuple(context_lens),
        sampled=tuple(sampled),
    )


def packed_attention(query, key, value, key_cache, value_cache, meta: StepMetadata, scale: float) -> torch.Tensor:
    """Attention of one layer for a packed step.

    ``query`` ``[total_tokens, num_heads, head_dim]``, ``key``/``value`` ``[total_tokens,
    num_kv_heads, head_dim]`` (this step's tokens). Writes the new K/V into the pools first, so
    every chunk (and every other chunk reading a block this step fills) sees them; returns
    ``[total_tokens, num_heads, head_dim]``."""
    minipaged_ops.reshape_and_cache(key, value, key_cache, value_cache, meta.slot_mapping)
    nd = meta.num_decodes
    if nd == len(meta.query_lens):
        return minipaged_ops.paged_attention_decode(
            query, key_cache, value_cache, meta.block_tables, meta.seq_lens, scale)
    out = query.new_empty(query.shape)
    if nd:
        out[:nd] = minipaged_ops.paged_attention_decode(
            query[:nd].contiguous(), key_cache, value_cache, meta.block_tables[:nd], meta.seq_lens[:nd], scale)
    out[nd:] = prefill_attention(query[nd:], key_cache, value_cache, meta, scale, key[nd:], value[nd:])
    return out


def prefill_attention(query, key_cache, value_cache, meta: StepMetadata, scale: float,
                      key=None, value=None) -> torch.Tensor:
    """Causal attention of the prefill chunks (rows ``num_decodes ..``) over their paged history
    and themselves. The one switch point: the ``paged_attention_prefill`` op when this build has
    it, else a gather of each chunk's blocks and SDPA (a chunk without history attends to
    ``key``/``value``, this step's own rows, when given: no gather)."""
    nd = meta.num_decodes
    if PREFILL_BACKEND == "op" or (PREFILL_BACKEND == "auto" and hasattr(torch.ops.minipaged, "paged_attention_prefill")):
        cu = meta.query_start_loc[nd:] - meta.query_start_loc[nd]
        return torch.ops.minipaged.paged_attention_prefill(
            query.contiguous(), key_cache, value_cache, meta.block_tables[nd:], cu, meta.seq_lens[nd:],
            scale, max(meta.query_lens[nd:]))
    return _gather_sdpa_prefill(query, key_cache, value_cache, meta, scale, key, value)


def _gather_sdpa_prefill(query, key_cache, value_cache, meta: StepMetadata, scale: float, key, value) -> torch.Tensor:
    nd = meta.num_decodes
    block_size = key_cache.shape[2]
    outs, row = [], 0
    for i in range(nd, len(meta.query_lens)):
        q_len, ctx = meta.query_lens[i], meta.context_lens[i]
        q = query[row:row + q_len].transpose(0, 1)  # [heads, q_len, head_dim]
        if q_len == ctx and key is not None:  # no history: this step's rows are the whole context
            k, v = key[row:row + q_len].transpose(0, 1), value[row:row + q_len].transpose(0, 1)
        else:
            blocks = meta.block_tables[i, : -(-ctx // block_size)].to(torch.int64)
            k, v = _gather(key_cache, blocks, ctx), _gather(value_cache, blocks, ctx)
        row += q_len
        if q_len == ctx:  # no history: plain causal
            o = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
        else:  # query j sits at position ctx - q_len + j and sees keys up to it
            pos = torch.arange(ctx - q_len, ctx, device=q.device)
            mask = torch.arange(ctx, device=q.device)[None, :] <= pos[:, None]
            o = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
        outs.append(o.transpose(0, 1))
    return torch.cat(outs, 0)


def _gather(cache: torch.Tensor, blocks: torch.Tensor, ctx: int) -> torch.Tensor:
    """``[num_kv_heads, ctx, head_dim]`` of one sequence, read through its block table."""
    kv = cache.index_select(0, blocks)  # [n, kv_heads, block_size, head_dim]
    return kv.transpose(0, 1).reshape(cache.shape[1], -1, cache.shape[3])[:, :ctx]


def _to(t: torch.Tensor, device) -> torch.Tensor:
    return t if device is None else t.to(device)
