"""``PagedKVCache``: a transformers ``Cache`` whose keys and values live in a pool of fixed-size
blocks, handed out on demand by a :class:`minipaged_ops.block_manager.KVBlockManager`.

It is a thin adapter: the pools, the block manager and the block copies are a
:class:`~.kv_pool.KVPool` (the engine's), every step is planned by the engine's planner
(``planner.plan_step``) and every attention layer runs the engine's ``packed_attention`` on the
step's real tokens (``attention.py``): it writes their K/V with ``reshape_and_cache``, then
attends with ``paged_attention_decode`` (decode steps) or ``paged_attention_prefill`` (prompts
and continued conversations, over their paged history). ``cache.update`` returns the new K/V
untouched.

Control plane (outside ``forward``): a forward pre-hook on the top-level model sees
``input_ids``, the attention mask and the cache before every forward. The batch's rows
(:class:`~.cache_batch.CacheBatch`) then allocate slots through the block manager (pad tokens of
left-padded batches are not part of the step, so they are never stored), perform the
copy-on-write block copies the manager asks for, and plan the step. A forward post-hook then
commits the step (the sequence length transformers sees grows by the number of new columns).
"""

from __future__ import annotations

import math
import weakref

import torch

from minipaged_ops import quantized
from minipaged_ops.block_manager import KVBlockManager, OutOfBlocksError

from . import _compat
from .attention import ATTN_IMPLEMENTATION
from .cache_batch import CacheBatch
from .kv_pool import KVPool, check_full_attention, kv_geometry


class PagedLayer(_compat.CacheLayerMixin):
    """One decoder layer's view of a :class:`PagedKVCache`; ``keys``/``values`` are the layer's
    block pools ``[num_blocks, num_kv_heads, block_size, head_dim]``. Everything goes through
    the owning cache; this object exists for transformers' per-layer queries."""

    is_compileable = True
    is_sliding = False
    is_croppable = False

    def __init__(self, owner: "PagedKVCache", layer_idx: int):
        super().__init__()
        self._owner = owner
        self.layer_idx = layer_idx

    def lazy_initialization(self, key_states, value_states) -> None:  # pools are made by the cache
        pass

    def update(self, key_states, value_states, *args, **kwargs):
        return self._owner.update(key_states, value_states, self.layer_idx)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self._owner.get_mask_sizes(query_length, self.layer_idx)

    def get_seq_length(self) -> int:
        return self._owner.get_seq_length(self.layer_idx)

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:  # the cache resets everything at once
        pass

    def reorder_cache(self, beam_idx) -> None:  # done by the cache, through the block manager
        pass


class PagedKVCache(_compat.Cache):
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
        self._kv_cache_dtype, self._calculate_kv_scales = kv_cache_dtype, calculate_kv_scales
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
        self.pool: KVPool | None = None  # made when the cache binds to its model
        max_pos = getattr(config, "max_position_embeddings", None)
        self._batch = CacheBatch(self.block_manager,
                                 min(num_blocks, math.ceil(max_pos / block_size)) if max_pos else num_blocks)
        super().__init__(layers=[PagedLayer(self, i) for i in range(self.num_layers)])
        if model is not None and dtype is not None and dtype != model.dtype:
            raise ValueError(_dtype_mismatch(dtype, model.dtype))
        self._dtype, self._device = dtype, None if device is None else torch.device(device)

        self._columns = 0  # sequence length as transformers sees it (padding columns included)
        self._in_step = False
        self._step_columns = 0
        self.peak_blocks_used = 0

        self._models: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()
        if model is not None:
            self.attach(model)

    # ------------------------------------------------------------------ public

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
        self._models.add(model)
        self._ensure_pool(model)
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
        raise NotImplementedError("PagedKVCache cannot be cropped (assisted decoding is not supported)")

    def __repr__(self) -> str:
        return (
            f"PagedKVCache(num_blocks={self.num_blocks}, block_size={self.block_size}, layers={self.num_layers}, "
            f"sequences={len(self._batch.rows)}, free_blocks={self.block_manager.num_free_blocks})"
        )

    # ------------------------------------------------------------------ hook side

    def _begin_step(self, model, input_ids, inputs_embeds, attention_mask) -> None:
        source = input_ids if input_ids is not None else inputs_embeds
        if source is None:
            raise ValueError("PagedKVCache: the forward received neither input_ids nor inputs_embeds")
        batch, q = source.shape[:2]
        device = source.device
        if model not in self._models:
            if self._models or getattr(model, "config", None) is not self._source_config:
                raise RuntimeError(
                    f"PagedKVCache: a {type(model).__name__} that this cache is not attached to ran a forward "
                    "with it; build the cache as PagedKVCache(model, ...) or call cache.attach(model)"
                )
            self._models.add(model)  # hooked by another cache, and built from our config object
        self._ensure_pool(model)
        self._check_pool(device, model.dtype)
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
                    self._batch.extend(q, tokens, new_real, self.pool, device)
        except OutOfBlocksError as err:
            # the batch cannot go on: free it, so the cache is ready for the next generate
            self.reset()
            raise OutOfBlocksError(
                f"{err} (the cache was reset: its sequences were released)", needed=err.needed, free=err.free
            ) from None
        self.peak_blocks_used = max(self.peak_blocks_used, self.num_blocks - self.block_manager.num_free_blocks)
        self._step_columns = q
        self._in_step = True

    def _attention_kwargs(self) -> dict:
        """What the forward passes down to the attention function this step: the step's metadata
        and the pools."""
        return {"minipaged_step": self._batch.step, "minipaged_kv_caches": self.pool.kv_caches,
                "minipaged_kv_scales": self.pool.kv_scales}

    def _end_step(self) -> None:
        if self._in_step:
            self._columns += self._step_columns
            self._in_step = False

    def _regather(self, src_rows: list[int]) -> None:
        if self._in_step:
            raise RuntimeError("PagedKVCache: cannot reorder during a forward")
        self._batch.regather(src_rows)

    # ------------------------------------------------------------------ the pools

    def _ensure_pool(self, model: torch.nn.Module) -> None:
        """Allocate the pools for ``model`` (geometry from its attention modules) if not yet made."""
        if self.pool is not None:
            return
        param = next(model.parameters())
        dtype = self._dtype if self._dtype is not None else param.dtype
        self._check_dtype(dtype, param.dtype)
        device = self._device if self._device is not None else param.device
        self._model_dtype = dtype
        self.pool = KVPool(kv_geometry(model), self.block_manager, dtype=quantized.cache_dtype(self._kv_cache_dtype, dtype),
                           device=device, calculate_kv_scales=self._calculate_kv_scales)
        self.pool.mark_static()
        for layer, (k, v) in zip(self.layers, self.pool.kv_caches):
            layer.keys, layer.values, layer.is_initialized = k, v, True
            layer.device = device

    def _check_pool(self, device: torch.device, dtype: torch.dtype) -> None:
        have = self.pool.device
        if have.type != device.type or (device.index is not None and have.index != device.index):
            raise ValueError(f"PagedKVCache pools are on {have} but the model runs on {device}")
        self._check_dtype(self._model_dtype, dtype)

    @staticmethod
    def _check_dtype(cache_dtype: torch.dtype, model_dtype: torch.dtype) -> None:
        if cache_dtype != model_dtype:
            raise ValueError(_dtype_mismatch(cache_dtype, model_dtype))


def _dtype_mismatch(cache_dtype: torch.dtype, model_dtype: torch.dtype) -> str:
    name = lambda d: str(d).removeprefix("torch.")
    return (
        f"PagedKVCache: the cache holds {name(cache_dtype)} but the model computes in {name(model_dtype)}; "
        f"build the cache with dtype=torch.{name(model_dtype)} (or leave dtype unset)"
    )


# ---------------------------------------------------------------------- hooks


def attach_hooks(model: torch.nn.Module) -> None:
    """Install the minipaged forward pre/post hooks on ``model`` once. They act only on calls
    that receive a :class:`PagedKVCache`."""
    if getattr(model, "_minipaged_hooks", None) is not None:
        return
    pre = model.register_forward_pre_hook(_pre_forward, with_kwargs=True)
    post = model.register_forward_hook(_post_forward, with_kwargs=True, always_call=True)
    model._minipaged_hooks = (pre, post)


def detach_hooks(model: torch.nn.Module) -> None:
    """Remove the hooks :func:`attach_hooks` installed (a no-op if there are none)."""
    handles = getattr(model, "_minipaged_hooks", None)
    if handles is not None:
        for h in handles:
            h.remove()
        model._minipaged_hooks = None


@torch.compiler.disable
def _pre_forward(module, args, kwargs):
    cache = _compat.find_cache(args, kwargs)
    if not isinstance(cache, PagedKVCache):
        return None
    impl = _compat.attention_implementation(module)
    if impl != ATTN_IMPLEMENTATION:
        raise ValueError(
            f"PagedKVCache needs attn_implementation={ATTN_IMPLEMENTATION!r} but the model uses {impl!r}: "
            f"import minipaged_ops.integration and call model.set_attn_implementation({ATTN_IMPLEMENTATION!r})"
        )
    input_ids, inputs_embeds, attention_mask = _compat.find_inputs(args, kwargs)
    cache._begin_step(module, input_ids, inputs_embeds, attention_mask)
    return args, {**kwargs, **cache._attention_kwargs()}


@torch.compiler.disable
def _post_forward(module, args, kwargs, output):
    cache = _compat.find_cache(args, kwargs)
    if isinstance(cache, PagedKVCache):
        cache._end_step()
    return None
