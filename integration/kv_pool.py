"""The KV pool: one model's paged K/V memory, shared by :class:`LLMEngine` and :class:`PagedKVCache`.

It holds every layer's ``(key_cache, value_cache)`` pools ``[num_blocks, num_kv_heads, block_size,
head_dim]``, the :class:`KVBlockManager` that hands their blocks out, and the three things that
move K/V between blocks: copy-on-write copies, swap out to host memory and swap back in.

The geometry (layers, kv heads, head_dim) is read from the model's own attention modules, not its
config: a model whose attention was sharded across ranks holds only its share of the kv heads.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable, Optional

import torch

import minipaged_ops
from minipaged_ops import quantized
from minipaged_ops.block_manager import KVBlockManager

from . import _compat

__all__ = ["KVGeometry", "KVPool", "LayerScales", "SwappedKV", "blocks_for_memory", "check_full_attention",
           "kv_geometry"]


@dataclass(frozen=True)
class KVGeometry:
    num_layers: int
    num_kv_heads: int  # per layer, on this rank
    head_dim: int

    def bytes_per_block(self, block_size: int, dtype: torch.dtype) -> int:
        """K and V bytes of one block id across all layers (an int8 pool's scales included)."""
        element = torch.empty((), dtype=dtype).element_size()
        scales = quantized.scale_bytes_per_block(dtype, self.num_kv_heads, block_size)
        return self.num_layers * (2 * self.num_kv_heads * block_size * self.head_dim * element + scales)


def attention_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The attention module of every decoder layer, in layer order: the modules with an int
    ``layer_idx``, a ``head_dim`` and a ``k_proj`` (transformers' Llama-family attention)."""
    found: dict[int, torch.nn.Module] = {}
    for module in _compat.unwrap_model(model).modules():
        if isinstance(getattr(module, "layer_idx", None), int) and hasattr(module, "k_proj") and hasattr(module, "head_dim"):
            found[module.layer_idx] = module
    if not found or sorted(found) != list(range(len(found))):
        raise ValueError(f"{type(model).__name__}: expected attention modules with layer_idx 0..n-1, a head_dim and "
                         f"a k_proj; found layers {sorted(found)}")
    return [found[i] for i in range(len(found))]


def kv_geometry(model: torch.nn.Module) -> KVGeometry:
    """Layers, kv heads and head_dim as the model's attention modules compute them (kv heads from
    ``k_proj``'s output features, so a sharded projection gives this rank's share, and a quantized
    one, which has no ``weight``, its own)."""
    layers = attention_modules(model)
    shapes = {(int(m.k_proj.out_features) // int(m.head_dim), int(m.head_dim)) for m in layers}
    if len(shapes) != 1:
        raise ValueError(f"{type(model).__name__}: the layers differ in (kv heads, head_dim): {sorted(shapes)}")
    num_kv_heads, head_dim = shapes.pop()
    return KVGeometry(len(layers), num_kv_heads, head_dim)


def check_full_attention(config, who: str) -> None:
    """Raise ValueError naming the first layer that is not full attention (sliding windows are not
    paged)."""
    types = _compat.layer_types(config)
    bad = [(i, t) for i, t in enumerate(types) if t != "full_attention"]
    if bad:
        i, t = bad[0]
        raise ValueError(
            f"{who} supports full-attention layers only; layer {i} is {t!r} ({len(bad)} of {len(types)} layers "
            f"are not full attention, e.g. sliding_window={getattr(config, 'sliding_window', None)})")


@dataclass(frozen=True)
class SwappedKV:
    """A sequence's blocks in host memory, ``[layers, blocks, kv_heads, block_size, head_dim]``, and an
    int8 pool's scales of them, ``[layers, blocks, kv_heads, block_size]``."""

    keys: torch.Tensor
    values: torch.Tensor
    key_scales: torch.Tensor | None = None
    value_scales: torch.Tensor | None = None


@dataclass
class LayerScales:
    """One layer's scales in an 8-bit pool (``minipaged_ops.quantized``): int8's, one per token and kv
    head ``[num_blocks, num_kv_heads, block_size]``, written with the tokens and moved with their blocks;
    fp8's, one K and one V scale for the layer (1.0, or with ``pending`` set from the first batch
    written and then frozen, as vLLM's ``calculate_kv_scales``)."""

    key: torch.Tensor
    value: torch.Tensor
    pending: bool = False
    # tensor parallelism: replaces a tensor of this rank's maxima by the maxima over the ranks, so
    # every rank's share of the heads gets the scales one process would set
    amax_all_reduce: Optional[Callable[[torch.Tensor], None]] = None

    def calibrate(self, key: torch.Tensor, value: torch.Tensor, dtype: torch.dtype) -> None:
        """Set the fp8 scales from this batch's absolute maxima, once."""
        amax = torch.stack([key.detach().abs().amax(), value.detach().abs().amax()]).float()
        if self.amax_all_reduce is not None:
            self.amax_all_reduce(amax)
        scales = quantized.scale_for_amax(amax, dtype)
        self.key.copy_(scales[:1])
        self.value.copy_(scales[1:])
        self.pending = False


class KVPool:
    """Per-layer block pools of one model plus the block manager that hands their blocks out.

    Args:
        geometry: from :func:`kv_geometry` (the model's attention modules).
        block_manager: hands out the pools' blocks (its ``num_blocks`` and ``block_size`` size them).
        dtype, device: of the pools: the model's dtype, or an 8-bit one (``quantized.cache_dtype``
            of a ``kv_cache_dtype``), whose scales the pool then holds (``kv_scales``).
        huge_pages: CPU pools in 2 MiB transparent huge pages (see ``allocate_kv_cache``).
        calculate_kv_scales: fp8 pools: set each layer's scales from the first batch it writes.
        amax_all_reduce: with ``calculate_kv_scales`` under tensor parallelism, the maxima over the
            ranks (see ``LayerScales``).
    """

    def __init__(self, geometry: KVGeometry, block_manager: KVBlockManager, *, dtype: torch.dtype, device,
                 huge_pages: bool = True, calculate_kv_scales: bool = False, amax_all_reduce=None):
        self.geometry = geometry
        self.dtype = dtype
        self.device = torch.device(device)
        self.block_manager = block_manager
        shape = (block_manager.num_blocks, geometry.num_kv_heads, block_manager.block_size, geometry.head_dim)
        # empty, not zeros: the kernels read only slots below seq_lens, which were written first
        self.kv_caches: tuple[tuple[torch.Tensor, torch.Tensor], ...] = tuple(
            (minipaged_ops.allocate_kv_cache(shape, dtype, self.device, huge_pages),
             minipaged_ops.allocate_kv_cache(shape, dtype, self.device, huge_pages))
            for _ in range(geometry.num_layers))
        # One LayerScales per layer for an 8-bit pool, else None (what the attention passes to the ops).
        self.kv_scales: tuple[LayerScales, ...] | None = None
        if quantized.is_quantized(dtype):
            pending = calculate_kv_scales and dtype != torch.int8
            self.kv_scales = tuple(
                LayerScales(*quantized.new_scales(dtype, block_manager.num_blocks, geometry.num_kv_heads,
                                                  block_manager.block_size, self.device), pending=pending,
                            amax_all_reduce=amax_all_reduce)
                for _ in range(geometry.num_layers))

    @property
    def num_blocks(self) -> int:
        return self.block_manager.num_blocks

    @property
    def block_size(self) -> int:
        return self.block_manager.block_size

    @property
    def bytes_per_block(self) -> int:
        return self.geometry.bytes_per_block(self.block_size, self.dtype)

    @property
    def blocks_in_use(self) -> int:
        return self.num_blocks - self.block_manager.num_free_blocks

    def apply_copies(self) -> None:
        """Run the copy-on-write copies the block manager asked for, on every layer: before any
        K/V is written into the copies' destinations."""
        copies = self.block_manager.take_copies()
        if copies:
            self.copy_blocks(copies)

    def swap_out(self, seq_id) -> SwappedKV:
        """Copy a sequence's blocks to host memory and release it from the pool."""
        swapped = self.read_blocks(self.block_manager.block_table(seq_id))
        self.block_manager.release_sequence(seq_id)
        return swapped

    def blocks_to_swap_in(self, token_ids) -> int:
        """Blocks that :meth:`swap_in` of a sequence holding ``token_ids`` takes from the pool."""
        return self.block_manager.blocks_needed_to_allocate([token_ids])

    def swap_in(self, seq_id, token_ids, swapped: SwappedKV) -> None:
        """Re-create a swapped-out sequence holding ``token_ids`` and copy its blocks back (blocks
        the prefix cache still holds are reused, not copied)."""
        bm = self.block_manager
        cached = bm.create_sequence(seq_id, token_ids)
        first = cached // self.block_size
        self.write_blocks(bm.block_table(seq_id)[first:], swapped, first)

    # The K/V moves themselves, by block id. Everything that moves K/V between blocks goes through
    # these three: a tensor-parallel driver's pool records them for its workers to replay.

    def copy_blocks(self, copies) -> None:
        """Copy block ``src`` to block ``dst`` for every ``(src, dst)`` of ``copies``, all layers."""
        mapping = torch.tensor(copies, dtype=torch.int64).to(self.device)
        for layer, (key_cache, value_cache) in enumerate(self.kv_caches):
            minipaged_ops.copy_blocks(key_cache, value_cache, mapping, *self._scales_of(layer))

    def read_blocks(self, block_ids) -> SwappedKV:
        """The blocks' K/V of every layer, copied to host memory."""
        blocks = torch.tensor(block_ids, dtype=torch.int64).to(self.device)
        scales = ()
        if self.dtype == torch.int8:  # an int8 pool's scales are paged like it: they move with the blocks
            scales = (torch.stack([s.key.index_select(0, blocks) for s in self.kv_scales]).cpu(),
                      torch.stack([s.value.index_select(0, blocks) for s in self.kv_scales]).cpu())
        return SwappedKV(torch.stack([k.index_select(0, blocks) for k, _ in self.kv_caches]).cpu(),
                         torch.stack([v.index_select(0, blocks) for _, v in self.kv_caches]).cpu(), *scales)

    def write_blocks(self, block_ids, swapped: SwappedKV, first: int = 0) -> None:
        """Write ``swapped``'s blocks ``first ..`` (host copies from :meth:`read_blocks`) into ``block_ids``."""
        blocks = torch.tensor(block_ids, dtype=torch.int64).to(self.device)
        for layer, (key_cache, value_cache) in enumerate(self.kv_caches):
            # as bytes: torch has no index_copy_ for float8 on the CPU
            _bytes(key_cache).index_copy_(0, blocks, _bytes(swapped.keys[layer, first:].to(self.device)))
            _bytes(value_cache).index_copy_(0, blocks, _bytes(swapped.values[layer, first:].to(self.device)))
            if swapped.key_scales is not None:
                self.kv_scales[layer].key.index_copy_(0, blocks, swapped.key_scales[layer, first:].to(self.device))
                self.kv_scales[layer].value.index_copy_(0, blocks, swapped.value_scales[layer, first:].to(self.device))

    def _scales_of(self, layer: int) -> tuple:
        """(key_scale, value_scale) of a layer as the ops take them; (None, None) for a float pool."""
        if self.kv_scales is None:
            return None, None
        return self.kv_scales[layer].key, self.kv_scales[layer].value

    def mark_static(self) -> None:
        """Tell torch.compile the pools never move (a compiled step then takes them as constants)."""
        for key_cache, value_cache in self.kv_caches:
            torch._dynamo.mark_static_address(key_cache)
            torch._dynamo.mark_static_address(value_cache)

    def usage(self) -> dict:
        """The block manager's usage plus bytes: ``kv_bytes_used`` and ``kv_bytes_pool``."""
        usage = dict(self.block_manager.usage())
        usage["kv_bytes_used"] = usage["blocks_used"] * self.bytes_per_block
        usage["kv_bytes_pool"] = self.num_blocks * self.bytes_per_block
        return usage


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if quantized.is_quantized(t.dtype) else t


def blocks_for_memory(kv_cache_memory, bytes_per_block: int, device: torch.device, *, most: int, who: str) -> int:
    """Blocks that fit in ``kv_cache_memory`` (bytes, or a fraction in (0, 1] of free memory:
    device memory on CUDA, available RAM on CPU; None: 0.9 on CUDA, 0.2 on CPU), at most ``most``."""
    if kv_cache_memory is None:
        kv_cache_memory = 0.9 if device.type == "cuda" else 0.2
    if isinstance(kv_cache_memory, bool) or not isinstance(kv_cache_memory, (int, float)) or kv_cache_memory <= 0:
        raise ValueError(f"{who}: kv_cache_memory must be bytes (int > 0) or a fraction in (0, 1], got {kv_cache_memory!r}")
    if isinstance(kv_cache_memory, float):
        if kv_cache_memory > 1:
            raise ValueError(f"{who}: kv_cache_memory as a fraction must be in (0, 1], got {kv_cache_memory}")
        kv_cache_memory = int(kv_cache_memory * _free_memory(device))
    blocks = kv_cache_memory // bytes_per_block
    if blocks < 1:
        raise ValueError(f"{who}: kv_cache_memory={kv_cache_memory} bytes is less than one block ({bytes_per_block} bytes)")
    return int(min(blocks, most))


def _free_memory(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
