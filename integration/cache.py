"""``PagedKVCache``: a transformers ``Cache`` whose keys and values live in a pool of fixed-size
blocks, handed out on demand by a :class:`minipaged_ops.block_manager.KVBlockManager`.

It is a thin adapter: the pools, the block manager and the block copies are a
:class:`~.kv_pool.KVPool` (the engine's), every step is planned by the engine's planner
(``planner.plan_step``) and every attention layer runs the engine's ``packed_attention`` on the
step's real tokens (``attention.py``): it writes their K/V with ``reshape_and_cache``, then
attends with ``paged_attention_decode`` (decode steps) or ``paged_attention_prefill`` (prompts
and continued conversations, over their paged history). ``cache.update`` returns the new K/V
untouched.

Control plane (outside ``forward``): hooks on the top-level model (``cache_hooks.py``) hand
:meth:`PagedKVCache.prepare_forward` the ``input_ids``, the attention mask and the cache before
every forward. The batch's rows (:class:`~.cache_batch.CacheBatch`) then allocate slots through
the block manager (pad tokens of left-padded batches are not part of the step, so they are never
stored), perform the copy-on-write block copies the manager asks for, and plan the step; after
it, :meth:`PagedKVCache.commit_forward` grows the sequence length transformers sees by the new
columns. ``cache_binding.py``: which models the cache serves, and their pools;
``cache_layer.py``: each layer's view.
"""

from __future__ import annotations

import math

import torch

from minipaged_ops import quantized
from minipaged_ops.block_manager import KVBlockManager, OutOfBlocksError

from . import _compat
from .cache_batch import CacheBatch
from .cache_binding import ModelBinding, check_dtype
from .cache_hooks import HookedCache, attach_hooks, detach_hooks
from .cache_layer import PagedLayer
from .kv_pool import KVPool, check_full_attention

# PagedLayer and the hooks lived here before the split; they stay importable from here.
__all__ = ["PagedKVCache", "PagedLayer", "attach_hooks", "detach_hooks"]


class PagedKVCache(_compat.Cache, HookedCache):
    """A paged KV cache for ``model.generate(..., past_key_values=cache)`` with
    ``attn_implementation="minipaged"``.

    Args:
        config: the model itself (the cache binds to it at once, and ``dtype``/``device`` default
            to the model's; a ``torch.compile`` or PEFT wrapper is unwrapped), or its config (then
            bind it with :meth:`attach`; a model already hooked by another cache and built from
            this config object binds at its first forward with it).
        num_blocks: blocks in the pool (per layer; every layer holds its own pool of that size).
        block_size: token slots per block.
        enable_prefix_caching: full blocks are found again by their token prefix (across
            sequences in a batch, and after ``reset()`` for later prompts).
        dtype, device: of the pools; default to the model's.
        kv_cache_dtype: "auto" (the pools in ``dtype``), or "int8", "fp8_e4m3", "fp8_e5m2": 8-bit pools
            the ops quantize into and read from (minipaged_ops.quantized).
        calculate_kv_scales: fp8: each layer's scales from the first batch's absolute maximum (else 1.0).

    The cache needs a forward pre-hook on the model (it allocates blocks there, outside any
    compiled region), installed on the model it binds to. A forward of any other model with this
    cache, or of a model the cache cannot tell it is meant for, is an error that names ``attach``.
    """

    def __init__(
        self,
        config,
        num_blocks: int,
        block_size: int = 16,
        *,
        enable_prefix_caching: bool = True,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        kv_cache_dtype: str = "auto",
        calculate_kv_scales: bool = False,
    ):
        quantized.cache_dtype(kv_cache_dtype, torch.float32)  # ValueError naming an unknown one, now
        quantized.check_calculate_kv_scales(calculate_kv_scales, kv_cache_dtype)
        model = _compat.unwrap_model(config) if isinstance(config, torch.nn.Module) else None
        if model is not None:
            if getattr(model, "config", None) is None:
                raise TypeError(f"PagedKVCache: expected a transformers model or its config, got {type(config).__name__}")
            config = model.config
        self._source_config = config
        if hasattr(config, "get_text_config"):
            config = config.get_text_config(decoder=True)
        for name, value in (("num_blocks", num_blocks), ("block_size", block_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"PagedKVCache: {name} must be a positive int, got {value!r}")
        check_full_attention(config, "PagedKVCache")
        self.config = config
        self.num_layers = config.num_hidden_layers
        self.block_manager = KVBlockManager(num_blocks, block_size, enable_prefix_caching=enable_prefix_caching)
        max_pos = getattr(config, "max_position_embeddings", None)
        self._batch = CacheBatch(self.block_manager,
                                 min(num_blocks, math.ceil(max_pos / block_size)) if max_pos else num_blocks)
        super().__init__(layers=[PagedLayer(self, i) for i in range(self.num_layers)])
        if model is not None and dtype is not None:
            check_dtype(dtype, model.dtype)
        self._binding = ModelBinding(self.block_manager, self._source_config, dtype=dtype, device=device,
                                     kv_cache_dtype=kv_cache_dtype, calculate_kv_scales=calculate_kv_scales)

        self._columns = 0  # sequence length as transformers sees it (padding columns included)
        self._in_step = False
        self._step_columns = 0
        self.peak_blocks_used = 0

        if model is not None:
            self.attach(model)

    # ------------------------------------------------------------------ public

    @property
    def pool(self) -> KVPool | None:
        """The pools, made when the cache binds to its model (None before)."""
        return self._binding.pool

    @property
    def num_blocks(self) -> int:
        return self.block_manager.num_blocks

    @property
    def block_size(self) -> int:
        return self.block_manager.block_size

    @property
    def key_cache(self) -> list[torch.Tensor]:
        return [k for k, _ in self.pool.kv_caches] if self.pool is not None else []

    @property
    def value_cache(self) -> list[torch.Tensor]:
        return [v for _, v in self.pool.kv_caches] if self.pool is not None else []

    @property
    def bytes_per_block(self) -> int:
        """K and V bytes of one block id across all layers (0 until the cache binds to a model)."""
        return self.pool.bytes_per_block if self.pool is not None else 0

    def usage(self) -> dict:
        """The block manager's usage plus bytes held (``kv_bytes_used``) and the pool size."""
        u = self.pool.usage() if self.pool is not None else dict(self.block_manager.usage(), kv_bytes_used=0,
                                                                    kv_bytes_pool=0)
        u["peak_blocks_used"] = self.peak_blocks_used
        return u

    @property
    def sequence_ids(self) -> list[int]:
        """Block-manager sequence id of each batch row."""
        return list(self._batch.rows)

    def attach(self, model: torch.nn.Module) -> "PagedKVCache":
        """Bind the cache to ``model`` (a ``torch.compile`` or PEFT wrapper is unwrapped), install
        the (idempotent, cache-agnostic) pre/post forward hooks on it and allocate the pools in
        its dtype and device."""
        model = _compat.unwrap_model(model)
        attach_hooks(model)
        if self._binding.attach(model):
            self._bind_layers()
        return self

    def reset(self, clear_prefix_cache: bool = False) -> None:
        """Release every sequence: all blocks go back to the pool. With prefix caching, full
        blocks stay findable until reused, so a later prompt sharing a prefix finds them again;
        ``clear_prefix_cache=True`` forgets them too."""
        self._batch.reset(clear_prefix_cache)
        self._columns = 0
        self._in_step = False

    # --------------------------------------------------------- transformers Cache API

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """Returns this step's K/V untouched: the attention function writes them into their
        slots and reads the history through the step's metadata."""
        if not self._in_step:
            raise RuntimeError(
                "PagedKVCache.update called outside a prepared forward: the model is not attached to "
                "this cache, which cannot tell which model it is meant for. Build it as "
                "PagedKVCache(model, ...) or call cache.attach(model) first."
            )
        return key_states, value_states

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self._columns

    def get_query_offset(self, layer_idx: int = 0) -> int:
        if self._in_step and self._batch.decoding:
            return 0  # see get_mask_sizes: a constant inside the compiled decode step
        return self._columns

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        """Mask extent. A decode step (one new token per live sequence) attends through the
        block tables and ignores the mask, so its mask is a constant ``[batch, 1, 1, 1]``
        (offsets 0): the compiled decode step then has no input whose shape or value changes
        from step to step (no recompilation, CUDA graphs replay as recorded)."""
        if query_length == 1 and self._batch.rows:
            return 1, 0
        return self._columns + query_length, 0

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return -1

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: row ``i`` continues the hypothesis of old row ``beam_idx[i]``. Re-points
        block tables (fork = shared blocks, reference counted; copy-on-write at the next append)
        instead of copying any K/V."""
        self._regather(beam_idx.tolist())

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._regather(indices.tolist())

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._regather([i for i in range(len(self._batch.rows)) for _ in range(repeats)])

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last ``-tokens_to_remove`` columns of every row: assisted generation (prompt
        lookup, an assistant model) takes back the candidates the model rejected. Their blocks go
        back to the pool and none of them stays findable by prefix (the block manager's
        ``truncate``). A positive argument is the length to keep (the older call's meaning)."""
        if self._in_step:
            raise RuntimeError("PagedKVCache: cannot crop during a forward")
        if isinstance(tokens_to_remove, torch.Tensor) and tokens_to_remove.dim() == 0 and \
                not tokens_to_remove.is_floating_point():
            tokens_to_remove = int(tokens_to_remove)  # transformers 5.17's assisted generation passes one
        if isinstance(tokens_to_remove, bool) or not isinstance(tokens_to_remove, int):
            raise TypeError(f"PagedKVCache.crop: tokens_to_remove must be an int, got {tokens_to_remove!r}")
        remove = -tokens_to_remove if tokens_to_remove <= 0 else self._columns - tokens_to_remove
        if remove <= 0:
            return
        if remove > self._columns:
            raise ValueError(f"PagedKVCache.crop: cannot remove {remove} of the cache's {self._columns} columns")
        self._batch.crop(self._columns, remove)
        self._columns -= remove

    def __repr__(self) -> str:
        return (
            f"PagedKVCache(num_blocks={self.num_blocks}, block_size={self.block_size}, layers={self.num_layers}, "
            f"sequences={len(self._batch.rows)}, free_blocks={self.block_manager.num_free_blocks})"
        )

    # ------------------------------------------------------------------ hook side

    def prepare_forward(self, model, input_ids, inputs_embeds, attention_mask) -> dict:
        """Called by the forward pre-hook (``cache_hooks``): allocate this forward's slots, copy
        the blocks the manager asks for and plan the step. Returns what the forward passes down
        to the attention function: the step's metadata and the pools."""
        source = input_ids if input_ids is not None else inputs_embeds
        if source is None:
            raise ValueError("PagedKVCache: the forward received neither input_ids nor inputs_embeds")
        batch, q = source.shape[:2]
        device = source.device
        if self._binding.admit(model, device):
            self._bind_layers()
        tokens = input_ids.tolist() if input_ids is not None else None
        rows = self._batch.rows
        if rows and batch != len(rows):
            raise ValueError(
                f"PagedKVCache holds {len(rows)} sequences but the forward has batch {batch}; "
                "call cache.reset() before generating for a new batch"
            )
        try:
            if q == 1 and rows:
                # decode: every row appends its token (generate never feeds padding after the prompt)
                self._batch.decode(tokens, self.pool, device)
            else:
                past = self._columns
                real = _compat.padding_mask(attention_mask, batch, past + q, device)
                new_real = real[:, past:].tolist() if real is not None else [[True] * q for _ in range(batch)]
                if not rows:
                    self._batch.start(batch, q, tokens, new_real, device)
                else:
                    self._batch.extend(past, q, tokens, new_real, self.pool, device)
        except OutOfBlocksError as err:
            # the batch cannot go on: free it, so the cache is ready for the next generate
            self.reset()
            raise OutOfBlocksError(
                f"{err} (the cache was reset: its sequences were released)", needed=err.needed, free=err.free
            ) from None
        self.peak_blocks_used = max(self.peak_blocks_used, self.num_blocks - self.block_manager.num_free_blocks)
        self._step_columns = q
        self._in_step = True
        return {"minipaged_step": self._batch.step, "minipaged_kv_caches": self.pool.kv_caches,
                "minipaged_kv_scales": self.pool.kv_scales}

    def commit_forward(self) -> None:
        """Called by the forward post-hook (also after a forward that raised): the sequence length
        transformers sees grows by the step's columns."""
        if self._in_step:
            self._columns += self._step_columns
            self._in_step = False

    def _regather(self, src_rows: list[int]) -> None:
        if self._in_step:
            raise RuntimeError("PagedKVCache: cannot reorder during a forward")
        self._batch.regather(src_rows)

    def _bind_layers(self) -> None:
        """Point each layer's ``keys``/``values`` at its pools, once they are made."""
        device = self.pool.device
        for layer, (k, v) in zip(self.layers, self.pool.kv_caches):
            layer.keys, layer.values, layer.is_initialized = k, v, True
            layer.device = device
