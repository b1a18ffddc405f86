"""The step planner: the host side of one forward over many sequences packed into one row.

It turns the chunks a scheduler picked (for each sequence: the tokens computed this step and where
they start) into a frozen :class:`StepMetadata`, the one thing the attention of every layer reads
(``attention.packed_attention``). A generate() batch is the same thing: every sequence's prompt as one chunk, then one
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

__all__ = ["ScheduledChunk", "StepMetadata", "plan_step"]


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
    # the logits of every token of the chunk are needed, not only the last one's (prompt logprobs)
    all_logits: bool = False
    # trailing tokens that are speculative proposals (a verify chunk, with all_logits): the
    # step's commit keeps those the model agrees with and cuts the sequence back past the rest
    num_proposals: int = 0


@dataclass(frozen=True)
class StepMetadata:
    """Everything the layers read in one packed step. Tensors are on the model's device."""

    input_ids: torch.Tensor  # int64 [total_tokens]
    position_ids: torch.Tensor  # int64 [total_tokens]
    slot_mapping: torch.Tensor  # int64 [total_tokens]: where each token's K/V is written
    block_tables: torch.Tensor  # int32 [num_seqs, max_blocks]
    seq_lens: torch.Tensor  # int32 [num_seqs]: tokens each sequence holds once this step is written
    query_start_loc: torch.Tensor  # int32 [num_seqs + 1]: cu_seqlens_q, chunk i is rows [q[i], q[i+1])
    logits_indices: torch.Tensor  # int64 [num_logits]: the rows whose logits are computed
    num_decodes: int  # chunks 0 .. num_decodes-1 are one token each
    query_lens: tuple[int, ...]  # host copies, so the prefill path needs no device sync
    context_lens: tuple[int, ...]  # = seq_lens on the host
    sampled: tuple[int, ...]  # chunk index of each sampled chunk ...
    sample_rows: tuple[int, ...]  # ... and the row of the logits its next token is sampled from
    # (chunk index, first logits row, rows) of each all_logits chunk: one row per chunk token
    all_logits_rows: tuple[tuple[int, int, int], ...] = ()
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
    query_lens, context_lens, logits_rows, sampled, sample_rows, all_rows = [], [], [], [], [], []
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
        if chunk.all_logits:
            all_rows.append((i, len(logits_rows), n))
            logits_rows.extend(range(len(input_ids) - n, len(input_ids)))
        if chunk.sample:
            if not chunk.all_logits:
                logits_rows.append(len(input_ids) - 1)
            sampled.append(i)
            sample_rows.append(len(logits_rows) - 1)
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
        sample_rows=tuple(sample_rows),
        all_logits_rows=tuple(all_rows),
    )


def _to(t: torch.Tensor, device) -> torch.Tensor:
    return t if device is None else t.to(device)
