"""The three ops the integration calls: the compiled ``torch.ops.minipaged.*`` when the package's
library is built, else the pure-PyTorch reference (correct, slow, eager only: it reads tensors on
the host, so it cannot be traced by ``torch.compile(fullgraph=True)``)."""

from __future__ import annotations

import warnings

import torch


def _load():
    try:
        import minipaged_ops  # noqa: F401  (loads the compiled library into torch.ops.minipaged)

        ops = torch.ops.minipaged
        return ops.reshape_and_cache, ops.paged_attention_decode, ops.copy_blocks, True
    except (ImportError, AttributeError, RuntimeError) as err:
        from minipaged_ops import reference

        warnings.warn(
            f"minipaged_ops.integration: compiled ops unavailable ({err}); using the pure-PyTorch "
            "reference (slow, and not traceable by torch.compile)",
            RuntimeWarning,
            stacklevel=3,
        )
        return reference.reshape_and_cache, reference.paged_attention_decode, reference.copy_blocks, False


reshape_and_cache, paged_attention_decode, copy_blocks, COMPILED = _load()
