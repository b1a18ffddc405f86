"""Pure-PyTorch versions of every minipaged op: slow, obvious, the oracle of the tests.

Each function follows its op's contract (the schema comments in src_cuda/registration.cpp)
exactly, including its corner cases (negative slots are skipped, ``seq_len == 0`` gives a zero
row, table entries past a sequence's length are never looked at). They compute in whatever dtype they are handed;
the tests hand them float64.
"""

from __future__ import annotations

import torch

from .quantized import FORMAT_MAX, is_quantized

_FLOAT32_MAX = torch.finfo(torch.float32).max


def quantize(x, cache_dtype, scale=None):
    """Rows ``x`` (``[..., head_dim]``, any float dtype) in an 8-bit cache dtype, as the kernels write
    them (float32 arithmetic, so the bytes agree exactly). ``int8``: one scale per row, amax / 127,
    returned; fp8: ``scale`` (the layer's, a float32 tensor) given, values saturated. Returns
    ``(q, scale)``."""
    x = x.float()
    # Divisions tensor by tensor: torch turns `127.0 / t` into `t.reciprocal() * 127`, which rounds
    # differently from the kernels' 127.f / amax.
    if cache_dtype == torch.int8:
        amax = x.abs().amax(-1)
        code_max = torch.full_like(amax, 127.0)
        inv = torch.where(amax > 0, torch.div(code_max, amax).clamp(max=_FLOAT32_MAX), torch.zeros_like(amax))
        q = torch.round(x * inv[..., None]).clamp(-127, 127).to(torch.int8)
        return q, torch.div(amax, code_max)
    scale = scale.float().reshape(())
    inv = torch.div(torch.ones_like(scale), scale)
    limit = FORMAT_MAX[cache_dtype]
    return (x * inv).clamp(-limit, limit).to(cache_dtype), scale


def dequantize(cache, scale):
    """An 8-bit cache (or rows of one) in float64: ``int8`` times its per-row scales (``cache``'s
    shape less head_dim), fp8 times the layer's scale. A float cache is returned as it is."""
    if not is_quantized(cache.dtype):
        return cache
    scale = scale.double()
    if cache.dtype == torch.int8:
        return cache.double() * scale[..., None]
    return cache.double() * scale.reshape(())


def reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, key_scale=None, value_scale=None) -> None:
    """Write token ``i`` of ``key``/``value`` into slot ``slot_mapping[i]``; skip negative slots.
    An 8-bit cache gets the rows quantized (``quantize``), int8's scales into ``key_scale``/``value_scale``."""
    block_size = key_cache.shape[2]
    for i, slot in enumerate(slot_mapping.tolist()):
        if slot < 0:
            continue
        block, offset = divmod(slot, block_size)
        for rows, cache, scales in ((key[i], key_cache, key_scale), (value[i], value_cache, value_scale)):
            if not is_quantized(cache.dtype):
                cache[block, :, offset, :] = rows
                continue
            q, row_scales = quantize(rows, cache.dtype, scales)
            cache[block, :, offset, :] = q
            if cache.dtype == torch.int8:
                scales[block, :, offset] = row_scales


def gather_kv(key_cache, value_cache, block_table, seq_len: int):
    """The first ``seq_len`` tokens of one sequence as contiguous ``[num_kv_heads, seq_len, head_dim]``."""
    block_size = key_cache.shape[2]
    num_blocks = -(-seq_len // block_size)
    blocks = block_table[:num_blocks].long()
    k = key_cache[blocks].transpose(0, 1).flatten(1, 2)[:, :seq_len]
    v = value_cache[blocks].transpose(0, 1).flatten(1, 2)[:, :seq_len]
    return k, v


def paged_attention_decode(query, key_cache, value_cache, block_tables, seq_lens, scale: float, key_scale=None,
                           value_scale=None):
    """``softmax(q·Kᵀ·scale)·V`` per sequence and head, K/V read through the block table (an 8-bit
    cache dequantized first, in float64)."""
    key_cache, value_cache = dequantize(key_cache, key_scale), dequantize(value_cache, value_scale)
    num_seqs, num_heads, head_dim = query.shape
    num_kv_heads = key_cache.shape[1]
    group = num_heads // num_kv_heads
    out = torch.zeros_like(query)
    for s, seq_len in enumerate(seq_lens.tolist()):
        if seq_len == 0:
            continue
        k, v = gather_kv(key_cache, value_cache, block_tables[s], seq_len)
        k = k.repeat_interleave(group, dim=0).to(query.dtype)
        v = v.repeat_interleave(group, dim=0).to(query.dtype)
        scores = torch.einsum("hd,htd->ht", query[s], k) * scale
        probs = torch.softmax(scores, dim=-1)
        out[s] = torch.einsum("ht,htd->hd", probs, v)
    return out


def paged_attention_prefill(query, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens, scale: float,
                            key_scale=None, value_scale=None):
    """Causal ``softmax(Q·Kᵀ·scale)·V`` for each sequence's packed new tokens: new token ``j`` of
    sequence ``i`` (``q_i`` of them) sits at position ``seq_lens[i] - q_i + j`` and sees positions
    ``0 ..`` its own, read through the block table (an 8-bit cache dequantized first)."""
    key_cache, value_cache = dequantize(key_cache, key_scale), dequantize(value_cache, value_scale)
    num_kv_heads = key_cache.shape[1]
    group = query.shape[1] // num_kv_heads
    out = torch.zeros_like(query)
    offsets = cu_seqlens_q.tolist()
    for s, seq_len in enumerate(seq_lens.tolist()):
        begin, end = offsets[s], offsets[s + 1]
        if begin == end:
            continue
        k, v = gather_kv(key_cache, value_cache, block_tables[s], seq_len)
        k = k.repeat_interleave(group, dim=0).to(query.dtype)
        v = v.repeat_interleave(group, dim=0).to(query.dtype)
        scores = torch.einsum("jhd,htd->hjt", query[begin:end], k) * scale
        positions = torch.arange(seq_len - (end - begin), seq_len)
        future = torch.arange(seq_len)[None, :] > positions[:, None]  # [q_i, seq_len]
        scores = scores.masked_fill(future, float("-inf"))
        out[begin:end] = torch.einsum("hjt,htd->jhd", torch.softmax(scores, dim=-1), v)
    return out


def copy_blocks(key_cache, value_cache, block_mapping, key_scale=None, value_scale=None) -> None:
    """For each row ``(src, dst)`` of ``block_mapping``, copy block ``src`` over block ``dst`` (and
    an int8 cache's scales of it)."""
    for src, dst in block_mapping.tolist():
        key_cache[dst] = key_cache[src]
        value_cache[dst] = value_cache[src]
        if key_cache.dtype == torch.int8:
            key_scale[dst] = key_scale[src]
            value_scale[dst] = value_scale[src]


def apply_token_bitmask_(logits, bitmask, indices) -> None:
    """``logits[r, t] = -inf`` for each row ``r`` of ``indices`` and each token ``t`` whose bit
    ``t % 32`` of ``bitmask[r, t // 32]`` is clear, or that lies past the bitmask."""
    vocab = logits.shape[1]
    for r in indices.tolist():
        words = bitmask[r].tolist()
        for t in range(vocab):
            if t // 32 >= len(words) or not (words[t // 32] >> (t % 32)) & 1:
                logits[r, t] = float("-inf")
