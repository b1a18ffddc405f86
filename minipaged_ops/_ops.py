"""Thin typed wrappers over ``torch.ops.minipaged`` and the fake (meta) kernels for torch.compile.

The schemas live in C++ (src_cuda/registration.cpp); nothing here re-declares them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

_ops = torch.ops.minipaged


@contextlib.contextmanager
def dispatching_to(namespace: str) -> Iterator[None]:
    """Within the block, the wrappers below call ``torch.ops.<namespace>`` (same schemas), e.g.
    ``minipaged_emu``, the emulated CUDA kernels (see ``minipaged_ops.emulation``)."""
    global _ops
    previous, _ops = _ops, getattr(torch.ops, namespace)
    try:
        yield
    finally:
        _ops = previous


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    key_scale: torch.Tensor | None = None,
    value_scale: torch.Tensor | None = None,
) -> None:
    """Write ``key[i]``/``value[i]`` (``[num_tokens, num_kv_heads, head_dim]``) into slot
    ``slot_mapping[i]`` of the caches, in place. Negative slots are skipped.

    8-bit caches (dtype ``int8``, ``float8_e4m3fn``, ``float8_e5m2``) are quantized here: ``int8``
    writes each token's and kv head's float32 scale into ``key_scale``/``value_scale``
    (``[num_blocks, num_kv_heads, block_size]``); fp8 divides by the layer's scales (one float32
    element each) and saturates. See ``minipaged_ops.quantized`` for pools and scales."""
    _ops.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, key_scale, value_scale)


def paged_attention_decode(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    max_seq_len: int | None = None,
    key_scale: torch.Tensor | None = None,
    value_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """One-token attention per sequence over its cached K/V, read through ``block_tables``.

    ``query`` is ``[num_seqs, num_heads, head_dim]``; returns the same shape and dtype.
    ``max_seq_len``, if given, must bound ``seq_lens``; it only narrows the CUDA grid.
    An 8-bit cache takes its scales (as ``reshape_and_cache``) and dequantizes as it reads.
    """
    return _ops.paged_attention_decode(query, key_cache, value_cache, block_tables, seq_lens, scale, max_seq_len,
                                       key_scale, value_scale)


def paged_attention_prefill(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    max_query_len: int | None = None,
    key_scale: torch.Tensor | None = None,
    value_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention for the new tokens of several sequences over their cached K/V.

    ``query`` is ``[total_q, num_heads, head_dim]``, sequence ``i``'s ``q_i`` new tokens in rows
    ``cu_seqlens_q[i]:cu_seqlens_q[i + 1]`` (int32 ``[n + 1]``). ``seq_lens`` (int32 ``[n]``) counts
    each sequence's tokens *including* the new ones, whose K/V must already be in the cache; new
    token ``j`` sits at position ``seq_lens[i] - q_i + j`` and sees positions up to its own.
    Returns the query's shape and dtype. ``max_query_len``, if given, must bound every ``q_i``.
    An 8-bit cache takes its scales (as ``reshape_and_cache``) and dequantizes as it reads.
    """
    return _ops.paged_attention_prefill(
        query, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens, scale, max_query_len, key_scale,
        value_scale
    )


def copy_blocks(
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_mapping: torch.Tensor,
    key_scale: torch.Tensor | None = None,
    value_scale: torch.Tensor | None = None,
) -> None:
    """Copy block ``src`` over block ``dst`` in both caches for each row of ``block_mapping``
    (int64 ``[n, 2]``); destinations must be distinct and not also sources. An ``int8`` cache's
    scales are copied with their blocks (fp8's, one per layer, are left as they are)."""
    _ops.copy_blocks(key_cache, value_cache, block_mapping, key_scale, value_scale)


def linear_widened(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                   weight_scale: torch.Tensor | None = None, weight_zero: torch.Tensor | None = None) -> torch.Tensor:
    """``input @ weight.T + bias`` for a float32, bfloat16, float16, int8 or int4 ``weight``
    (``[out_features, in_features]``), computed in float32 (the weight stays in its format in
    memory). An int8 weight takes ``weight_scale`` (``[out_features]``, one scale per output row:
    ``(input @ weight.T) * weight_scale``). An int4 weight is uint8 ``[out_features, in_features / 2]``,
    each 32 weights in 16 bytes (byte ``i`` holds weight ``i`` in its low nibble and weight ``16 + i``
    in its high one), with ``weight_scale`` and ``weight_zero`` ``[out_features, groups]`` (float32 or
    bfloat16; groups of a multiple of 32 columns): weight ``(q - zero) * scale``. Up to 24 input
    rows stream the weight once for all of them, more widen it a block of rows at a time into the
    float32 GEMM (bfloat16 for int8 and int4 on CPUs with bfloat16 dot products). Returns
    ``input``'s dtype. CPU only: for CPUs without 16-bit dot products, for few-row steps (decode,
    speculative verify) and for weight-only quantization."""
    return _ops.linear_widened(input, weight, bias, weight_scale, weight_zero)


def apply_token_bitmask_(logits: torch.Tensor, bitmask: torch.Tensor, indices: torch.Tensor) -> None:
    """In place: ``logits[r, t] = -inf`` for each row ``r`` of ``indices`` (int64) and each token
    ``t`` whose bit is clear in ``bitmask[r]`` (int32 ``[rows, ceil(vocab / 32)]``, token ``t`` at
    bit ``t % 32`` of word ``t // 32``, xgrammar's layout); tokens past the bitmask are masked too.
    CPU only: a grammar's allowed tokens (structured outputs)."""
    _ops.apply_token_bitmask_(logits, bitmask, indices)


@torch.library.register_fake("minipaged::linear_widened")
def _linear_widened_fake(input, weight, bias=None, weight_scale=None, weight_zero=None):
    return input.new_empty((*input.shape[:-1], weight.size(0)))


@torch.library.register_fake("minipaged::paged_attention_decode")
def _paged_attention_decode_fake(query, key_cache, value_cache, block_tables, seq_lens, scale, max_seq_len=None,
                                 key_scale=None, value_scale=None):
    torch._check(query.dim() == 3, lambda: f"query: expected 3-D [num_seqs, num_heads, head_dim], got {query.dim()}-D")
    return query.new_empty(query.shape)


@torch.library.register_fake("minipaged::paged_attention_prefill")
def _paged_attention_prefill_fake(query, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens, scale,
                                  max_query_len=None, key_scale=None, value_scale=None):
    torch._check(query.dim() == 3, lambda: f"query: expected 3-D [total_q, num_heads, head_dim], got {query.dim()}-D")
    return query.new_empty(query.shape)


@torch.library.register_fake("minipaged::reshape_and_cache")
def _reshape_and_cache_fake(key, value, key_cache, value_cache, slot_mapping, key_scale=None, value_scale=None):
    return None


@torch.library.register_fake("minipaged::copy_blocks")
def _copy_blocks_fake(key_cache, value_cache, block_mapping, key_scale=None, value_scale=None):
    return None


def build_info() -> str:
    """One line saying which backends this build compiled and, when CUDA is missing, why."""
    return _ops.build_info()


def cpu_isa() -> str:
    """The instruction-set variant of the CPU kernels in use: ``scalar``, ``avx2``, ``avx512``,
    ``avx512_bf16`` or ``avx512_amx`` (``native`` in a MINIPAGED_NATIVE_CPU build). The best this CPU supports
    unless the environment variable ``MINIPAGED_CPU_ISA`` named another when minipaged loaded."""
    return _ops.cpu_isa()


def supported_cpu_isas() -> list[str]:
    """The compiled CPU kernel variants this CPU can run, worst first (build_info() lists all
    compiled ones)."""
    return list(_ops.supported_cpu_isas())


def compiled_backends() -> list[str]:
    """The dispatch keys that have minipaged kernels in this build, e.g. ``["CPU", "CUDA"]``."""
    has = torch._C._dispatch_has_kernel_for_dispatch_key
    return [key for key in ("CPU", "CUDA") if has("minipaged::paged_attention_decode", key)]
