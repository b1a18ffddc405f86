"""transformers integration of the minipaged ops (installed as ``minipaged_ops.integration``).

Importing it registers the ``"minipaged"`` attention implementation in transformers'
``AttentionInterface`` and ``AttentionMaskInterface`` (idempotent)::

    import minipaged_ops.integration
    from minipaged_ops.integration import PagedKVCache

    model.set_attn_implementation("minipaged")
    cache = PagedKVCache(model, num_blocks=256, block_size=16)
    out = model.generate(input_ids, attention_mask=mask, past_key_values=cache, max_new_tokens=64)

Layout: ``kv_pool`` (the per-layer pools, the block manager, copies and swaps), ``planner`` (a
step's metadata, host side), ``attention`` (what runs inside each layer), ``cache`` (the
``generate()`` adapter) with ``cache_batch`` (its batch's rows and the plan of each forward),
``cache_hooks`` (the forward hooks that drive it), ``cache_binding`` (the models it serves and
their pools) and ``cache_layer`` (a layer's view), ``engine/`` (the serving engine).
"""

from minipaged_ops.block_manager import OutOfBlocksError

from . import _compat
from .attention import ATTN_IMPLEMENTATION, minipaged_attention_forward, minipaged_mask
from .cache import PagedKVCache, attach_hooks, detach_hooks
from .engine import (AsyncLLMEngine, CompletionOutput, LLMEngine, RequestMetrics, RequestOutput, SamplingParams,
                     StructuredOutputsParams)
from .kv_pool import KVPool
from .planner import ScheduledChunk, StepMetadata, plan_step

__all__ = [
    "ATTN_IMPLEMENTATION",
    "AsyncLLMEngine",
    "CompletionOutput",
    "KVPool",
    "LLMEngine",
    "OutOfBlocksError",
    "PagedKVCache",
    "RequestMetrics",
    "RequestOutput",
    "SamplingParams",
    "StructuredOutputsParams",
    "ScheduledChunk",
    "StepMetadata",
    "attach_hooks",
    "detach_hooks",
    "minipaged_attention_forward",
    "minipaged_mask",
    "plan_step",
    "register",
]


def register() -> None:
    """Register ``"minipaged"`` in transformers' attention and mask interfaces (idempotent)."""
    _compat.register(ATTN_IMPLEMENTATION, minipaged_attention_forward, minipaged_mask)


register()
