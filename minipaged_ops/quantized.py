"""8-bit KV caches: the ``kv_cache_dtype`` names, their torch dtypes, and their scales.

``int8`` is symmetric with one float32 scale per token and kv head, computed by
``reshape_and_cache`` when the token is written and kept beside the pool as
``[num_blocks, num_kv_heads, block_size]`` (paged like it, so ``copy_blocks`` moves them together).
``fp8_e4m3`` / ``fp8_e5m2`` (torch ``float8_e4m3fn`` / ``float8_e5m2``) take one float32 scale per
layer for K and one for V (1.0 unless set, e.g. from a batch's absolute maximum with
``layer_scales_for``); values beyond the format's range saturate.
"""

from __future__ import annotations

import torch

KV_CACHE_DTYPES = {
    "int8": torch.int8,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}
# The largest magnitude each 8-bit format stores.
FORMAT_MAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}


def is_quantized(dtype: torch.dtype) -> bool:
    return dtype in FORMAT_MAX


def cache_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The pool's dtype for ``kv_cache_dtype`` ("auto": the model's own)."""
    if kv_cache_dtype == "auto":
        return model_dtype
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(
            f"kv_cache_dtype: expected 'auto', {', '.join(repr(k) for k in KV_CACHE_DTYPES)}, got {kv_cache_dtype!r}"
        )
    return KV_CACHE_DTYPES[kv_cache_dtype]


def check_calculate_kv_scales(calculate_kv_scales, kv_cache_dtype) -> None:
    """``calculate_kv_scales`` sets the fp8 formats' per-layer scales (int8's are per token, float
    pools have none): a ValueError for it with any other ``kv_cache_dtype``, or for a non-bool."""
    if not isinstance(calculate_kv_scales, bool):
        raise ValueError(f"calculate_kv_scales: expected a bool, got {calculate_kv_scales!r}")
    if calculate_kv_scales and kv_cache_dtype not in ("fp8_e4m3", "fp8_e5m2"):
        raise ValueError("calculate_kv_scales=True sets the fp8 formats' per-layer scales: it needs kv_cache_dtype "
                         f"'fp8_e4m3' or 'fp8_e5m2', got {kv_cache_dtype!r}")


def cache_dtype_name(dtype: torch.dtype) -> str:
    """What a pool of ``dtype`` is called: its ``kv_cache_dtype`` name ("int8", "fp8_e4m3",
    "fp8_e5m2"), or a float pool's torch name ("float32", "bfloat16", "float16")."""
    names = {v: k for k, v in KV_CACHE_DTYPES.items()}
    return names.get(dtype, str(dtype).removeprefix("torch."))


def new_scales(dtype: torch.dtype, num_blocks: int, num_kv_heads: int, block_size: int, device=None):
    """The (key_scale, value_scale) a pool of ``dtype`` needs: ``(None, None)`` for a float pool,
    per-token zeros for int8 (written with the tokens), ones for fp8."""
    if dtype == torch.int8:
        shape = (num_blocks, num_kv_heads, block_size)
        return (torch.zeros(shape, dtype=torch.float32, device=device),
                torch.zeros(shape, dtype=torch.float32, device=device))
    if is_quantized(dtype):
        return torch.ones(1, device=device), torch.ones(1, device=device)
    return None, None


def scale_bytes_per_block(dtype: torch.dtype, num_kv_heads: int, block_size: int) -> int:
    """Bytes of scales one block of K and V carries (int8: a float32 per token and kv head each)."""
    return 2 * num_kv_heads * block_size * 4 if dtype == torch.int8 else 0


def layer_scale_for(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """An fp8 layer scale from a batch of K (or V) rows: absolute maximum / the format's maximum,
    as vLLM's calculate_kv_scales does (1.0 for an all-zero batch). A float32 tensor of one element."""
    return scale_for_amax(rows.detach().abs().amax().float().reshape(1), dtype)


def scale_for_amax(amax: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """fp8 scales from float32 absolute maxima: ``amax`` / the format's maximum (1.0 where it is 0)."""
    scale = amax / FORMAT_MAX[dtype]
    return torch.where(scale > 0, scale, torch.ones_like(scale))
