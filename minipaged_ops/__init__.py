"""minipaged: a paged KV cache for PyTorch models.

``import minipaged_ops`` loads the compiled ops into ``torch.ops.minipaged`` and exposes typed
wrappers, the block manager and the pure-PyTorch reference. The transformers integration is a
separate import (``minipaged_ops.integration``) so that this one never imports transformers.
"""

import torch

try:
    from . import _C  # noqa: F401  (registers torch.ops.minipaged.*)
except ImportError as err:  # pragma: no cover - only on a broken install
    raise ImportError(
        "minipaged_ops: the compiled library _C is missing or does not load "
        f"({err}). Build it with `pip install --no-build-isolation -e .` against the installed torch."
    ) from err

from . import reference
from ._ops import (
    apply_token_bitmask_,
    build_info,
    compiled_backends,
    copy_blocks,
    cpu_isa,
    linear_widened,
    paged_attention_decode,
    paged_attention_prefill,
    reshape_and_cache,
    supported_cpu_isas,
)
from .block_manager import KVBlockManager, OutOfBlocksError
from .memory import allocate_kv_cache

__all__ = [
    "KVBlockManager",
    "OutOfBlocksError",
    "allocate_kv_cache",
    "apply_token_bitmask_",
    "build_info",
    "compiled_backends",
    "copy_blocks",
    "cpu_isa",
    "linear_widened",
    "paged_attention_decode",
    "paged_attention_prefill",
    "reference",
    "reshape_and_cache",
    "supported_cpu_isas",
]
__version__ = "0.1.0"
