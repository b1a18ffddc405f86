"""What :class:`~.llm_engine.LLMEngine`'s constructor is given: the checks of its arguments (a
ValueError that names the argument and what was expected, before anything is built), and what it
reads from the model and sizes from memory."""

from __future__ import annotations

import torch

from .. import _compat
from ..kv_pool import blocks_for_memory
from .front_door import is_int
from .scheduler import POLICIES, PREEMPTION_MODES

__all__ = ["check_engine_args", "default_block_size", "eos_token_ids", "model_len", "pool_blocks", "text_config"]

# Token slots per block when the caller names none, by device. On CUDA a block of 16 costs the
# kernels nothing. On the CPU each block is a scattered run the hardware prefetcher cannot follow
# into the next, so decode reads short runs slower than memory allows (bench/read_roof.py
# --also-block-sizes; the figures are in bench/RESULTS.md). 64 takes most of 128's gain at half its
# granularity (prefix reuse and the unused tail of each sequence's last block).
DEFAULT_BLOCK_SIZE = {"cuda": 16, "cpu": 64}


def check_engine_args(model, *, block_size, max_num_seqs, max_num_batched_tokens, preemption_mode,
                      scheduling_policy, seed, max_logprobs=20, max_model_len=None) -> None:
    if not _compat.is_pretrained_model(model):
        raise ValueError(f"LLMEngine: model must be a transformers PreTrainedModel, got {type(model).__name__}")
    for name, value in (("block_size", block_size), ("max_num_seqs", max_num_seqs),
                        ("max_num_batched_tokens", max_num_batched_tokens)):
        if name == "block_size" and value is None:  # the device's default
            continue
        if not is_int(value) or value < 1:
            raise ValueError(f"LLMEngine: {name} must be a positive int, got {value!r}")
    if max_num_batched_tokens < max_num_seqs:
        raise ValueError(f"LLMEngine: max_num_batched_tokens ({max_num_batched_tokens}) must be >= max_num_seqs "
                         f"({max_num_seqs}), or running sequences could not all decode in one step")
    if preemption_mode not in PREEMPTION_MODES:
        raise ValueError(f"LLMEngine: preemption_mode must be one of {PREEMPTION_MODES}, got {preemption_mode!r}")
    if scheduling_policy not in POLICIES:
        raise ValueError(f"LLMEngine: scheduling_policy must be one of {POLICIES}, got {scheduling_policy!r}")
    if not is_int(seed):
        raise ValueError(f"LLMEngine: seed must be an int, got {seed!r}")
    if not is_int(max_logprobs) or max_logprobs < -1:
        raise ValueError(f"LLMEngine: max_logprobs must be an int >= 0, or -1 for the whole vocabulary, "
                         f"got {max_logprobs!r}")
    if max_model_len is not None and (not is_int(max_model_len) or max_model_len < 2):
        raise ValueError(f"LLMEngine: max_model_len must be an int >= 2 (a prompt token and a generated one) or "
                         f"None, got {max_model_len!r}")


def model_len(max_model_len, *, max_position_embeddings: int, pool_tokens: int) -> int:
    """The longest sequence the engine runs: ``max_model_len`` when given (ValueError if the model's
    positions or the pool cannot hold it), else the shorter of the two."""
    if max_model_len is None:
        return min(max_position_embeddings, pool_tokens)
    for what, most in (("max_position_embeddings", max_position_embeddings), ("the KV pool's tokens", pool_tokens)):
        if max_model_len > most:
            raise ValueError(f"LLMEngine: max_model_len={max_model_len} exceeds {what} ({most})")
    return max_model_len


def default_block_size(device) -> int:
    """The engine's block size when none is given: 64 token slots on the CPU, 16 elsewhere."""
    return DEFAULT_BLOCK_SIZE.get(torch.device(device).type, DEFAULT_BLOCK_SIZE["cuda"])


def pool_blocks(num_blocks, kv_cache_memory, *, bytes_per_block: int, device, max_num_seqs: int,
                max_position_embeddings: int, block_size: int) -> int:
    """``num_blocks`` (checked), or when None the blocks that fit in ``kv_cache_memory`` (see
    :func:`..kv_pool.blocks_for_memory`), never more than ``max_num_seqs`` sequences of
    ``max_position_embeddings`` tokens need."""
    if num_blocks is None:
        most = max_num_seqs * -(-max_position_embeddings // block_size)
        return blocks_for_memory(kv_cache_memory, bytes_per_block, device, most=most, who="LLMEngine")
    if not is_int(num_blocks) or num_blocks < 1:
        raise ValueError(f"LLMEngine: num_blocks must be a positive int or None, got {num_blocks!r}")
    return num_blocks


def text_config(model):
    """The decoder's config (a multimodal model's text config)."""
    return model.config.get_text_config(decoder=True) if hasattr(model.config, "get_text_config") else model.config


def eos_token_ids(model) -> frozenset:
    """The ids of the model's generation config's end-of-sequence tokens (empty without one)."""
    eos = model.generation_config.eos_token_id if getattr(model, "generation_config", None) else None
    return frozenset([] if eos is None else [eos] if isinstance(eos, int) else eos)
