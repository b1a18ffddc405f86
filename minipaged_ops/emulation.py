"""The CUDA kernels emulated on the CPU, for testing without a GPU.

``torch.ops.minipaged_emu.*`` have the schemas of ``torch.ops.minipaged.*`` and run the CUDA
path, its bindings and the unchanged kernel source (src_cuda/cuda/*.cu), on CPU tensors through a
host emulation of the CUDA features the kernels use (src_cuda/emulation/). It is slow (each CUDA
thread is a fiber) and exists for the tests: ``with emulation.dispatch(): minipaged_ops.x(...)``.

``MINIPAGED_EMU_LIBRARY=/path/to/_emu.so`` loads another build of it, e.g. a sanitized one
(``make test-sanitize``).
"""

from __future__ import annotations

import contextlib
import importlib
import os
from collections.abc import Iterator

import torch

from ._ops import build_info, dispatching_to

_loaded: bool | None = None


def available() -> bool:
    """Whether the emulation extension was built (see ``unavailable_reason``) and loads."""
    global _loaded
    if _loaded is None:
        path = os.environ.get("MINIPAGED_EMU_LIBRARY")
        try:
            if path:
                torch.ops.load_library(path)
            else:
                importlib.import_module("minipaged_ops._emu")
            _register_fakes()
            _loaded = True
        except (ImportError, OSError):
            if path:
                raise  # asked for by name: a failure to load is an error, not a skip
            _loaded = False
    return _loaded


def _register_fakes() -> None:
    """Each emulated op's fake (for torch.compile) is the real op's: called on fake tensors."""
    for qualified in torch._C._dispatch_get_all_op_names():
        namespace, _, name = qualified.partition("::")
        if namespace != "minipaged_emu" or name == "build_info":
            continue
        real = getattr(torch.ops.minipaged, name)
        torch.library.register_fake(qualified)(lambda *args, _real=real, **kwargs: _real(*args, **kwargs))


def unavailable_reason() -> str:
    """Why the emulation is missing, from the build's one-line summary."""
    return build_info().rpartition("no CUDA emulation")[2].strip(" ()") or "minipaged_ops._emu does not load"


@contextlib.contextmanager
def dispatch() -> Iterator[None]:
    """Within the block, minipaged_ops' wrappers run the emulated CUDA kernels (CPU tensors)."""
    if not available():
        raise RuntimeError(f"minipaged_ops.emulation: not built: {unavailable_reason()}")
    with dispatching_to("minipaged_emu"):
        yield
