"""Moving page bytes between cache tensors and byte buffers: what every transport does at each end.

A page is one block of one cache tensor (`page_format`). Pages are copied as rows of the widest integer
word that divides a block's bytes, so every dtype (bfloat16, float8 included) moves bit for bit.
- `gather_pages` / `scatter_pages`: one cache tensor's pages to or from a 1-D uint8 tensor (CUDA caches
  staged through pinned host memory);
- `gather_transfer_into` / `scatter_transfer`: a whole transfer's pages in wire order (each layer's K
  pages, then its V pages) into memory the caller owns (a shared-memory span), or from its payloads.
  On CPU caches they copy with numpy, which moves each block as one run: ~4x torch's `index_copy_` and
  ~1.5x its `index_select` on this project's block sizes, with less setup per tensor.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from kv_transfer.base import KVCaches


def _block_rows(cache: torch.Tensor) -> torch.Tensor:
    """`cache` as [num_blocks, words]: the widest integer type that divides a block's bytes. Moving
    bytes this way copies every dtype (bfloat16 included) bit for bit, and torch's indexed copies run
    several times faster on 8-byte words than on single bytes."""
    rows = cache.view(torch.uint8).view(cache.shape[0], -1)
    for word in (torch.int64, torch.int32, torch.int16):
        if rows.shape[1] % word.itemsize == 0:
            return rows.view(word)
    return rows


def gather_pages(cache: torch.Tensor, block_ids: torch.Tensor, device: torch.device,
                 non_blocking: bool = False, heads: tuple[int, int] | None = None) -> torch.Tensor:
    """The given blocks of one cache tensor, in order, as a fresh contiguous 1-D uint8 tensor on
    `device`; with `heads` (offset, count into the cache's heads dimension), only those heads of each
    block. A CUDA cache bound for the host is staged through pinned memory; with `non_blocking` the copy
    is only queued, and the caller synchronizes the stream before reading the bytes."""
    if heads is None:
        pages = _block_rows(cache).index_select(0, block_ids).view(torch.uint8).view(-1)
    else:
        pages = cache.index_select(0, block_ids).narrow(2, *heads).contiguous().view(torch.uint8).view(-1)
    if pages.device == device:
        return pages
    if device.type == "cpu":
        host = torch.empty(pages.shape, dtype=torch.uint8, pin_memory=True)
        host.copy_(pages, non_blocking=non_blocking)
        return host
    return pages.to(device)


def gather_transfer_into(kv_caches: KVCaches, block_ids: torch.Tensor, out: torch.Tensor,
                         heads: tuple[int, int] | None = None) -> None:
    """A transfer's pages in wire order (each layer's K pages, then its V pages) of `block_ids`, written
    into `out`: 1-D uint8 host memory of exactly their size (e.g. a span of shared memory). One copy from a
    CPU cache; a CUDA cache's pages are gathered on the device and copied down once."""
    caches = [t for pair in kv_caches for t in pair]
    n = len(block_ids)
    if caches[0].device.type != "cpu":
        for cache, part in zip(caches, out.view(len(caches), -1)):
            part.copy_(gather_pages(cache, block_ids, cache.device, heads=heads))
    elif heads is not None:
        for cache, part in zip(caches, out.view(len(caches), -1)):
            src = cache.narrow(2, *heads)
            torch.index_select(src, 0, block_ids, out=part.view(cache.dtype).view(n, *src.shape[1:]))
    else:  # numpy copies each block as one run (~1.5x index_select), with less setup per tensor than torch
        ids = block_ids.numpy()
        for cache, part in zip(caches, out.numpy().reshape(len(caches), n, -1)):
            rows = _host_rows(cache)  # mode="clip": no buffered copy of `out`; `check_send` checked the ids
            np.take(rows, ids, axis=0, out=part.view(rows.dtype), mode="clip")


def scatter_transfer(kv_caches: KVCaches, block_ids: torch.Tensor, payloads: Sequence,
                     heads: tuple[int, int] | None = None) -> None:
    """Write a transfer's page payloads (wire order; byte buffers or 1-D uint8 tensors) into `block_ids`
    of the caches, as `scatter_pages` does for each of them."""
    caches = [t for pair in kv_caches for t in pair]
    if heads is not None or caches[0].device.type != "cpu":
        for cache, pages in zip(caches, payloads):
            scatter_pages(cache, block_ids, as_byte_tensor(pages), heads)
        return
    ids = block_ids.numpy()  # numpy copies each block as one run; index_copy_ is ~4x slower
    for cache, pages in zip(caches, payloads):
        rows = _host_rows(cache)
        pages = pages.numpy() if isinstance(pages, torch.Tensor) else np.frombuffer(pages, dtype=np.uint8)
        rows[ids] = pages.view(rows.dtype).reshape(len(ids), -1)


def _host_rows(cache: torch.Tensor) -> np.ndarray:
    """A CPU cache as numpy [num_blocks, words] over its memory, words as in `_block_rows`."""
    rows = cache.view(torch.uint8).numpy().reshape(cache.shape[0], -1)
    for word in (np.int64, np.int32, np.int16):
        if rows.shape[1] % np.dtype(word).itemsize == 0:
            return rows.view(word)
    return rows


def as_byte_tensor(payload) -> torch.Tensor:
    """A payload (a byte buffer or a 1-D uint8 tensor) as a uint8 tensor, without copying."""
    return payload if isinstance(payload, torch.Tensor) else torch.frombuffer(payload, dtype=torch.uint8)


def scatter_pages(cache: torch.Tensor, block_ids: torch.Tensor, pages: torch.Tensor,
                  heads: tuple[int, int] | None = None) -> None:
    """Write 1-D uint8 `pages` (len(block_ids) blocks, in order) into those blocks of `cache`; with
    `heads` (offset, count), the pages hold only those heads of each block, and only they are written.

    Pinned host pages bound for a CUDA cache are copied asynchronously, on the current stream: the
    caller synchronizes it before declaring the blocks written (`KVReceiver._complete` does)."""
    staged = cache.device.type == "cuda" and pages.device.type == "cpu" and pages.is_pinned()
    pages = pages.to(cache.device, non_blocking=staged)
    if heads is None:
        rows = _block_rows(cache)
        rows.index_copy_(0, block_ids, pages.view(rows.dtype).view(len(block_ids), -1))
        return
    _, block_size, _, head_dim = cache.shape
    part = cache.narrow(2, *heads)
    part.index_copy_(0, block_ids, pages.view(cache.dtype).view(len(block_ids), block_size, heads[1], head_dim))
