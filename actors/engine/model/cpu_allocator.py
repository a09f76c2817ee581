"""CPU: keep freed memory in the process for the next step instead of handing it back to the kernel, and
back the KV cache with huge pages.

glibc serves an allocation above its mmap threshold (at most 32 MiB by default) with a fresh mapping and
unmaps it on free, so every step's large activations (a prefill's gate/up output is tens of MiB) are
page-faulted in again, page by page. Raising the mmap and trim thresholds keeps that memory in the heap
and reuses it step after step: a 16 x 512-token prefill ran 15-20% faster here. The cost: the process
keeps its peak heap resident (what a serving process needs again at the next big step anyway).

The KV cache is read at random block boundaries every decode step; with 4 KiB pages each block costs TLB
misses the hardware prefetcher cannot run ahead of. Asked to use transparent huge pages (where the kernel
allows them on request, as /sys/kernel/mm/transparent_hugepage/enabled's "madvise" does), the CPU attention
kernel read 16 sequences x 2,048 tokens 1.3x faster here.
"""

from __future__ import annotations

import ctypes
import logging
import math
import mmap

import torch

log = logging.getLogger("tandem.engine")
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_KEEP_BYTES = 1 << 30
_HUGE_PAGE = 2 << 20
_done = False


def keep_freed_memory() -> bool:
    """Once per process; False where the C library is not glibc (nothing changes there)."""
    global _done
    if _done:
        return True
    try:
        libc = ctypes.CDLL("libc.so.6")
        ok = bool(libc.mallopt(_M_MMAP_THRESHOLD, _KEEP_BYTES)) and bool(libc.mallopt(_M_TRIM_THRESHOLD, _KEEP_BYTES))
    except (OSError, AttributeError):
        ok = False
    if not ok:
        log.info("could not raise the C allocator's mmap threshold: large CPU activations are mapped afresh each step")
    _done = ok
    return ok


def zeros_on_huge_pages(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed CPU tensor in a fresh anonymous mapping of its own (not the heap, which keeps_freed_memory
    makes serve allocations under 1 GiB from memory already touched), advised to use transparent huge pages
    before any page is touched; where the advice is refused it is an ordinary zeroed tensor."""
    count = math.prod(shape)
    if count == 0:
        return torch.zeros(shape, dtype=dtype)
    # Private: a shared anonymous mapping is shmem, whose huge pages are a separate, usually disabled, setting.
    # One huge page more than needed, so the tensor can start on a huge-page boundary.
    buffer = mmap.mmap(-1, count * dtype.itemsize + _HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        buffer.madvise(mmap.MADV_HUGEPAGE)
    except (AttributeError, OSError):  # not Linux, or a kernel without THP
        pass
    offset = -torch.frombuffer(buffer, dtype=torch.uint8, count=1).data_ptr() % _HUGE_PAGE
    # Zero-filled by the kernel, page by page on first touch; the tensor keeps the mapping alive.
    return torch.frombuffer(buffer, dtype=dtype, count=count, offset=offset).view(shape)
