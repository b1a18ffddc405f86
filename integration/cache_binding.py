"""Which models a :class:`~.cache.PagedKVCache` serves, and the pools it makes for the first one.

The pools take their geometry from the model's own attention modules (``kv_pool.kv_geometry``),
their dtype and device from the model unless the cache was given them. A model the cache was not
attached to may run a forward with it only when the cache has no model yet and was built from
that model's config object (another cache hooked the model): any other is an error that names
``attach``. Every forward checks the model still runs on the pools' device and in their dtype, so
a model moved or cast after binding fails with a clear error instead of a kernel's.
"""

from __future__ import annotations

import weakref

import torch

from minipaged_ops import quantized
from minipaged_ops.block_manager import KVBlockManager

from .kv_pool import KVPool, kv_geometry

__all__ = ["ModelBinding", "check_dtype"]


class ModelBinding:
    """The models a cache serves and its :class:`KVPool` (``pool``: None until the first binds).

    Args: as :class:`~.cache.PagedKVCache` takes them; ``source_config`` is the config object the
    cache was built from (the model's own, before ``get_text_config``).
    """

    def __init__(self, block_manager: KVBlockManager, source_config, *, dtype: torch.dtype | None,
                 device: torch.device | str | None, kv_cache_dtype: str, calculate_kv_scales: bool):
        self.block_manager = block_manager
        self.pool: KVPool | None = None
        self._source_config = source_config
        self._dtype, self._device = dtype, None if device is None else torch.device(device)
        self._kv_cache_dtype, self._calculate_kv_scales = kv_cache_dtype, calculate_kv_scales
        self._models: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()

    def attach(self, model: torch.nn.Module) -> bool:
        """Serve ``model`` (already unwrapped); make the pools for it if there are none yet.
        Returns whether this call made them."""
        self._models.add(model)
        return self._ensure_pool(model)

    def admit(self, model: torch.nn.Module, device: torch.device) -> bool:
        """Before a forward of ``model`` on ``device``: the error naming ``attach`` if it may not
        use this cache, else :meth:`attach` and the device and dtype checks. Returns whether this
        call made the pools."""
        if model not in self._models:
            if self._models or getattr(model, "config", None) is not self._source_config:
                raise RuntimeError(
                    f"PagedKVCache: a {type(model).__name__} that this cache is not attached to ran a forward "
                    "with it; build the cache as PagedKVCache(model, ...) or call cache.attach(model)"
                )
        made = self.attach(model)  # a new one here was hooked by another cache, built from our config object
        self._check_pool(device, model.dtype)
        return made

    def _ensure_pool(self, model: torch.nn.Module) -> bool:
        if self.pool is not None:
            return False
        param = next(model.parameters())
        dtype = self._dtype if self._dtype is not None else param.dtype
        check_dtype(dtype, param.dtype)
        device = self._device if self._device is not None else param.device
        self._model_dtype = dtype
        self.pool = KVPool(kv_geometry(model), self.block_manager, dtype=quantized.cache_dtype(self._kv_cache_dtype, dtype),
                           device=device, calculate_kv_scales=self._calculate_kv_scales)
        self.pool.mark_static()
        return True

    def _check_pool(self, device: torch.device, dtype: torch.dtype) -> None:
        have = self.pool.device
        if have.type != device.type or (device.index is not None and have.index != device.index):
            raise ValueError(f"PagedKVCache pools are on {have} but the model runs on {device}")
        check_dtype(self._model_dtype, dtype)


def check_dtype(cache_dtype: torch.dtype, model_dtype: torch.dtype) -> None:
    """Raise the error for a cache made for another dtype than the one the model computes in."""
    if cache_dtype != model_dtype:
        name = lambda d: str(d).removeprefix("torch.")
        raise ValueError(
            f"PagedKVCache: the cache holds {name(cache_dtype)} but the model computes in {name(model_dtype)}; "
            f"build the cache with dtype=torch.{name(model_dtype)} (or leave dtype unset)"
        )
