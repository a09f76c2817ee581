"""Helpers shared by the kv_transfer tests: deterministic caches and the expected result of transfers."""

from __future__ import annotations

from typing import Sequence

import torch

from kv_transfer.page_format import PageSpec, TransferHeader

Caches = list[tuple[torch.Tensor, torch.Tensor]]
WAIT_S = 10.0  # longest wait for a transfer's outcome


def make_caches(dtype: torch.dtype = torch.float32, *, num_layers: int = 2, num_blocks: int = 16, block_size: int = 4,
                num_kv_heads: int = 2, head_dim: int = 8, seed: int = 0) -> Caches:
    """Random caches, the same for the same arguments in any process."""
    g = torch.Generator().manual_seed(seed)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    return [(torch.randn(shape, generator=g).to(dtype), torch.randn(shape, generator=g).to(dtype))
            for _ in range(num_layers)]


def clone_caches(caches: Caches) -> Caches:
    return [(k.clone(), v.clone()) for k, v in caches]


def apply_transfer(caches: Caches, src_caches: Caches, src_ids: Sequence[int], dest_ids: Sequence[int]) -> Caches:
    """What the receiver's caches must hold after the transfer (computed without the transport)."""
    out = clone_caches(caches)
    for (k, v), (sk, sv) in zip(out, src_caches):
        for s, d in zip(src_ids, dest_ids):
            k[d] = sk[s]
            v[d] = sv[s]
    return out


def bit_equal(a: Caches, b: Caches) -> bool:
    """Same bytes everywhere (bit identity, not float equality)."""
    return len(a) == len(b) and all(
        torch.equal(x.view(torch.uint8), y.view(torch.uint8)) for pa, pb in zip(a, b) for x, y in zip(pa, pb))


def header_for(caches: Caches, dest_ids: Sequence[int], transfer_id: str = "t1", note: bytes = b"") -> TransferHeader:
    return TransferHeader(transfer_id, f"lease-{transfer_id}", PageSpec.from_caches(caches), tuple(dest_ids), note)
