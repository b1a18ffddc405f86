"""K/V pool allocation: on a Linux CPU, in transparent huge pages.

Paged decode reads a pool of tens or hundreds of MiB in scattered 8–64 KiB runs. In 4 KiB pages
nearly every run needs a fresh TLB entry; in 2 MiB pages one entry covers a whole run and its
neighbours (``bench/huge_pages.py``: decode 13–29% faster in float32 on the AMD EPYC dev VM).
"""

from __future__ import annotations

import ctypes
import sys

import torch

HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14  # Linux's value on every architecture


def _madvise_huge(address: int, length: int) -> bool:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.madvise(ctypes.c_void_p(address), ctypes.c_size_t(length), _MADV_HUGEPAGE) == 0
    except (OSError, AttributeError):
        return False


def allocate_kv_cache(shape, dtype: torch.dtype, device="cpu", huge_pages: bool = True) -> torch.Tensor:
    """An uninitialised tensor for a K or V pool, ``shape`` as the ops expect
    (``[num_blocks, num_kv_heads, block_size, head_dim]``).

    On a Linux CPU with ``huge_pages`` (the default), a pool of at least 2 MiB lies in memory advised
    ``MADV_HUGEPAGE`` before anything touches it, so the kernel backs it with 2 MiB pages where
    transparent huge pages are enabled (``madvise`` or ``always`` mode). Elsewhere, or when the
    advice is refused, it is a plain ``torch.empty``. The tensor may be a view into a storage up
    to 2 MiB larger (for the alignment); it owns that storage.
    """
    device = torch.device(device)
    nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
    if not huge_pages or device.type != "cpu" or not sys.platform.startswith("linux") or nbytes < HUGE_PAGE:
        return torch.empty(shape, dtype=dtype, device=device)
    # Untouched memory (a fresh allocation this large is its own mapping, not yet backed), aligned
    # to a huge page inside a slightly larger block.
    raw = torch.empty(nbytes + HUGE_PAGE, dtype=torch.uint8)
    start = -raw.data_ptr() % HUGE_PAGE
    if not _madvise_huge(raw.data_ptr() + start, -(-nbytes // HUGE_PAGE) * HUGE_PAGE):
        return torch.empty(shape, dtype=dtype, device=device)
    return raw[start:start + nbytes].view(dtype).view(shape)
