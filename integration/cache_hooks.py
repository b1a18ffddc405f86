"""The forward hooks that drive a paged cache from outside ``forward``.

A forward pre-hook on the top-level model sees ``input_ids``, the attention mask and the cache
before every forward, and a post-hook runs after it (also when the forward raised). They run
outside any compiled region, where the cache may allocate blocks, and act only on forwards that
receive a :class:`HookedCache`: one set of hooks per model serves every such cache (and none).
"""

from __future__ import annotations

import torch

from . import _compat
from .attention import ATTN_IMPLEMENTATION

__all__ = ["HookedCache", "attach_hooks", "detach_hooks"]


class HookedCache:
    """The part of a cache the hooks drive (:class:`~.cache.PagedKVCache` is one): before each
    forward it is passed to, ``prepare_forward`` plans the step and returns what the forward passes
    down to the attention function; after it, ``commit_forward`` records the step."""

    def prepare_forward(self, model: torch.nn.Module, input_ids, inputs_embeds, attention_mask) -> dict:
        raise NotImplementedError

    def commit_forward(self) -> None:
        raise NotImplementedError


def attach_hooks(model: torch.nn.Module) -> None:
    """Install the minipaged forward pre/post hooks on ``model`` once. They act only on calls
    that receive a :class:`HookedCache` (a :class:`~.cache.PagedKVCache`)."""
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
    if not isinstance(cache, HookedCache):
        return None
    impl = _compat.attention_implementation(module)
    if impl != ATTN_IMPLEMENTATION:
        raise ValueError(
            f"PagedKVCache needs attn_implementation={ATTN_IMPLEMENTATION!r} but the model uses {impl!r}: "
            f"import minipaged_ops.integration and call model.set_attn_implementation({ATTN_IMPLEMENTATION!r})"
        )
    input_ids, inputs_embeds, attention_mask = _compat.find_inputs(args, kwargs)
    return args, {**kwargs, **cache.prepare_forward(module, input_ids, inputs_embeds, attention_mask)}


@torch.compiler.disable
def _post_forward(module, args, kwargs, output):
    cache = _compat.find_cache(args, kwargs)
    if isinstance(cache, HookedCache):
        cache.commit_forward()
    return None
