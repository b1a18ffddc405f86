"""Proposals from a draft model: a smaller decoder with the target's vocabulary, on a paged pool of
its own (the same ``KVPool`` machinery as the engine's), kept in step with each sequence.

For the step's speculating sequences together, the draft computes what each lacks of its tokens
(one token after a fully accepted chunk, more after a rollback or a preemption) and then its own
argmax k times: one packed forward per proposal position for all of them. Proposing the argmax makes the proposer's distribution one-hot,
so the verify step keeps proposals by the same exact rule as n-gram proposals (``acceptance``):
outputs are those without speculation whatever the sampling controls.

The draft's cache follows the sequence by comparison, not by bookkeeping: before proposing, the
tokens it holds K/V for are compared with the sequence's, and it is cut back to their common
prefix (``KVBlockManager.truncate``). Rejected proposals, rolled-back steps and recomputed
sequences therefore need no hooks; sequences that stopped running are dropped at the next step
(:meth:`DraftModelProposer.retain`). A sequence the draft pool has no room for proposes nothing.
"""

from __future__ import annotations

from typing import Sequence

import torch

from minipaged_ops.block_manager import KVBlockManager

from ... import _compat
from ...attention import ATTN_IMPLEMENTATION
from ...kv_pool import KVPool, check_full_attention, kv_geometry
from ...linear16 import widen_linears
from ...planner import ScheduledChunk, plan_step
from ..engine_args import text_config

__all__ = ["DraftModelProposer", "load_draft_model"]


def load_draft_model(model, *, dtype: torch.dtype, device: torch.device, vocab_size: int):
    """The draft as a module: ``model`` itself, or the folder it names (loaded in the target's dtype,
    on its device, nothing downloaded). ValueError, naming ``speculative_config.model``, for a draft
    that cannot serve this target."""
    if isinstance(model, str):
        from transformers import AutoModelForCausalLM

        try:
            model = AutoModelForCausalLM.from_pretrained(model, dtype=dtype, local_files_only=True).to(device)
        except (OSError, ValueError) as err:
            raise ValueError(f"speculative_config.model: cannot load a causal LM from {model!r} ({err})") from None
    if not isinstance(model, torch.nn.Module):
        raise ValueError(f"speculative_config.model must be a model folder or a module, got {type(model).__name__}")
    config = text_config(model)
    if config.vocab_size != vocab_size:
        raise ValueError(f"speculative_config.model: the draft's vocabulary has {config.vocab_size} tokens, "
                         f"the target's {vocab_size}: they must share one tokenizer")
    check_full_attention(config, "speculative_config.model")
    return model.eval()


class DraftModelProposer:
    """``propose_batch([(seq_id, token_ids, limit), ...])``: up to ``limit`` tokens the draft expects
    next for each sequence (``propose`` for one)."""

    def __init__(self, model, num_speculative_tokens: int, *, num_blocks: int, block_size: int):
        param = next(model.parameters())
        self.model, self.device = model, param.device
        self.num_speculative_tokens = num_speculative_tokens
        block_manager = KVBlockManager(num_blocks, block_size, enable_prefix_caching=False)
        self.pool = KVPool(kv_geometry(model), block_manager, dtype=param.dtype, device=self.device)
        if self.device.type == "cpu":
            widen_linears(model)
        if _compat.attention_implementation(model) != ATTN_IMPLEMENTATION:
            model.set_attn_implementation(ATTN_IMPLEMENTATION)
        self._held: dict = {}  # seq_id -> the tokens whose K/V the draft's cache holds

    def retain(self, seq_ids) -> None:
        """Free the draft's cache of every sequence not in ``seq_ids``."""
        for seq_id in [s for s in self._held if s not in seq_ids]:
            self._drop(seq_id)

    def propose(self, seq_id, token_ids: Sequence[int], limit: int | None = None) -> list[int]:
        return self.propose_batch([(seq_id, token_ids, limit)]).get(seq_id, [])

    @torch.inference_mode()
    def propose_batch(self, items) -> dict:
        """``items``: ``(seq_id, token_ids, limit)`` of the step's speculating sequences; returns
        ``{seq_id: proposals}``. One draft forward per proposal position for all of them (k forwards
        a step, not k per sequence)."""
        bm = self.pool.block_manager
        pending = {}  # seq_id -> (tokens to compute next, proposals wanted)
        for seq_id, token_ids, limit in items:
            k = self.num_speculative_tokens if limit is None else min(limit, self.num_speculative_tokens)
            if k <= 0 or not token_ids:
                continue
            held = self._held.get(seq_id)
            if held is None:
                bm.create_sequence(seq_id, [])
                held = self._held[seq_id] = []
            common = _common_prefix(held, token_ids, len(token_ids) - 1)  # the last token is always computed
            if common < len(held):
                bm.truncate(seq_id, common)
                del held[common:]
            pending[seq_id] = (list(token_ids[common:]), k)
        proposals: dict = {seq_id: [] for seq_id in pending}
        while pending:
            chunks = []
            for seq_id, (new, _) in list(pending.items()):
                if bm.blocks_needed_to_append([(seq_id, len(new))]) > bm.num_free_blocks:
                    self._drop(seq_id)  # no room: it keeps what it has (maybe nothing)
                    del pending[seq_id]
                    continue
                held = self._held[seq_id]
                chunks.append(ScheduledChunk(seq_id, new, len(held)))
                bm.append_tokens(seq_id, new)
                held.extend(new)
            if not chunks:
                break
            choices = self._forward(chunks).argmax(-1).tolist()  # one row per chunk: its last token's
            for chunk, token in zip(chunks, choices):
                proposals[chunk.seq_id].append(token)
                k = pending[chunk.seq_id][1]
                if len(proposals[chunk.seq_id]) < k:
                    pending[chunk.seq_id] = ([token], k)
                else:
                    del pending[chunk.seq_id]
        return proposals

    def _forward(self, chunks: list) -> torch.Tensor:
        meta = plan_step(self.pool.block_manager, chunks, self.device)
        return self.model(
            input_ids=meta.input_ids[None], position_ids=meta.position_ids[None], use_cache=False,
            logits_to_keep=meta.logits_indices, minipaged_step=meta, minipaged_kv_caches=self.pool.kv_caches,
            minipaged_kv_scales=self.pool.kv_scales,
        ).logits[0]

    def _drop(self, seq_id) -> None:
        if self._held.pop(seq_id, None) is not None:
            self.pool.block_manager.release_sequence(seq_id)


def _common_prefix(a: Sequence[int], b: Sequence[int], limit: int) -> int:
    n = 0
    end = min(len(a), len(b), limit)
    while n < end and a[n] == b[n]:
        n += 1
    return n
