"""Pure-PyTorch versions of every minipaged op: slow, obvious, the oracle of the tests.

Each function follows the op contract in DESIGN.md exactly, including its corner cases
(negative slots are skipped, ``seq_len == 0`` gives a zero row, table entries past a
sequence's length are never looked at). They compute in whatever dtype they are handed;
the tests hand them float64.
"""

from __future__ import annotations

import torch


def reshape_and_cache(key, value, key_cache, value_cache, slot_mapping) -> None:
    """Write token ``i`` of ``key``/``value`` into slot ``slot_mapping[i]``; skip negative slots."""
    block_size = key_cache.shape[2]
    for i, slot in enumerate(slot_mapping.tolist()):
        if slot < 0:
            continue
        block, offset = divmod(slot, block_size)
        key_cache[block, :, offset, :] = key[i]
        value_cache[block, :, offset, :] = value[i]


def gather_kv(key_cache, value_cache, block_table, seq_len: int):
    """The first ``seq_len`` tokens of one sequence as contiguous ``[num_kv_heads, seq_len, head_dim]``."""
    block_size = key_cache.shape[2]
    num_blocks = -(-seq_len // block_size)
    blocks = block_table[:num_blocks].long()
    k = key_cache[blocks].transpose(0, 1).flatten(1, 2)[:, :seq_len]
    v = value_cache[blocks].transpose(0, 1).flatten(1, 2)[:, :seq_len]
    return k, v


def paged_attention_decode(query, key_cache, value_cache, block_tables, seq_lens, scale: float):
    """``softmax(q·Kᵀ·scale)·V`` per sequence and head, K/V read through the block table."""
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


def paged_attention_prefill(query, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens, scale: float):
    """Causal ``softmax(Q·Kᵀ·scale)·V`` for each sequence's packed new tokens: new token ``j`` of
    sequence ``i`` (``q_i`` of them) sits at position ``seq_lens[i] - q_i + j`` and sees positions
    ``0 ..`` its own, read through the block table."""
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


def copy_blocks(key_cache, value_cache, block_mapping) -> None:
    """For each row ``(src, dst)`` of ``block_mapping``, copy block ``src`` over block ``dst``."""
    for src, dst in block_mapping.tolist():
        key_cache[dst] = key_cache[src]
        value_cache[dst] = value_cache[src]
