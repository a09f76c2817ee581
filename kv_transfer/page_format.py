"""What a KV transfer is made of: the page spec both sides must agree on, and the one header codec.

A worker's KV cache is a list with one `(k_cache, v_cache)` pair per layer; each tensor is
`[num_blocks, block_size, num_kv_heads, head_dim]` and contiguous. A *page* is one block of one of
those tensors. `PageSpec` is everything about that layout except `num_blocks`, which is each
worker's own business (a sender and a receiver have pools of different sizes).

A tensor-parallel worker's rank holds only some KV heads of the model in its cache, so a transfer may
carry a slice of the heads: the header's spec describes the pages on the wire (its `num_kv_heads` is the
slice's width), and `first_head` / `total_kv_heads` place that slice in the model. A receiver takes a
slice that lies inside the heads its own cache holds of the same model.

`TransferHeader` is the small message that precedes the pages on the wire. `encode_header` and
`decode_header` are the only code that knows its byte layout (msgpack, with a version field).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Sequence

import msgpack
import torch

HEADER_VERSION = 3  # 2: the opaque `note` bytes replaced the `extra` map; 3: head slices
_HEADER_KEYS = {"v", "transfer_id", "lease_id", "spec", "dest_block_ids", "note", "heads"}


class PageFormatError(ValueError):
    """A header or page layout that this side cannot accept (mismatched spec, malformed bytes)."""


class TransferError(RuntimeError):
    """The transport failed: no receiver within the deadline, a dead peer, a broken connection."""


def _torch_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(dtype, torch.dtype):
        raise PageFormatError(f"unknown dtype {name!r}; expected a torch dtype name such as 'bfloat16'")
    return dtype


def _positive_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise PageFormatError(f"{name} must be a positive int, got {value!r}")


@dataclass(frozen=True)
class PageSpec:
    """The layout of one page; two workers can exchange pages only if their specs are equal."""

    dtype: str  # torch dtype name without the "torch." prefix, e.g. "bfloat16"
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int

    def __post_init__(self) -> None:
        _torch_dtype(self.dtype)
        for name in ("block_size", "num_layers", "num_kv_heads", "head_dim"):
            _positive_int(name, getattr(self, name))

    @classmethod
    def from_caches(cls, kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> PageSpec:
        """The spec of a worker's caches; raises PageFormatError if the layers disagree or are not paged."""
        if len(kv_caches) == 0:
            raise PageFormatError("kv_caches is empty; expected one (k_cache, v_cache) pair per layer")
        first = kv_caches[0][0]
        for layer, pair in enumerate(kv_caches):
            if len(pair) != 2:
                raise PageFormatError(f"layer {layer}: expected a (k_cache, v_cache) pair, got {len(pair)} tensors")
            for t in pair:
                if t.dim() != 4 or t.shape != first.shape or t.dtype != first.dtype or t.device != first.device:
                    raise PageFormatError(
                        f"layer {layer}: cache tensor {tuple(t.shape)} {t.dtype} on {t.device} differs from layer 0 "
                        f"{tuple(first.shape)} {first.dtype} on {first.device}; expected 4-D "
                        "[num_blocks, block_size, num_kv_heads, head_dim] tensors, all alike")
                if not t.is_contiguous():
                    raise PageFormatError(f"layer {layer}: cache tensors must be contiguous")
        _, block_size, num_kv_heads, head_dim = first.shape
        return cls(str(first.dtype).removeprefix("torch."), block_size, len(kv_caches), num_kv_heads, head_dim)

    @property
    def torch_dtype(self) -> torch.dtype:
        return _torch_dtype(self.dtype)

    @property
    def page_nbytes(self) -> int:
        """Bytes of one block of one K (or V) tensor of one layer."""
        return self.block_size * self.num_kv_heads * self.head_dim * self.torch_dtype.itemsize

    def transfer_nbytes(self, num_blocks: int) -> int:
        """Bytes of pages in a transfer of num_blocks blocks (all layers, K and V)."""
        return 2 * self.num_layers * num_blocks * self.page_nbytes

    def check_compatible(self, other: PageSpec, ignore: tuple[str, ...] = ()) -> None:
        """self is the sender's spec, other the receiver's; raises PageFormatError naming every mismatch
        (but those of the fields in `ignore`)."""
        diffs = [f"sender {f.name}={getattr(self, f.name)}, receiver {f.name}={getattr(other, f.name)}"
                 for f in fields(self) if f.name not in ignore and getattr(self, f.name) != getattr(other, f.name)]
        if diffs:
            raise PageFormatError("page format mismatch: " + "; ".join(diffs))


@dataclass(frozen=True)
class HeadSlice:
    """KV heads [first, first + count) of a model with `total` KV heads."""

    first: int
    count: int
    total: int

    def __post_init__(self) -> None:
        for name in ("count", "total"):
            _positive_int(name, getattr(self, name))
        if isinstance(self.first, bool) or not isinstance(self.first, int) or self.first < 0 \
                or self.first + self.count > self.total:
            raise PageFormatError(f"heads [{self.first}, {self.first}+{self.count}) do not lie in the model's "
                                  f"{self.total} KV heads")

    @classmethod
    def whole(cls, num_kv_heads: int) -> HeadSlice:
        return cls(0, num_kv_heads, num_kv_heads)

    @property
    def end(self) -> int:
        return self.first + self.count

    def contains(self, other: HeadSlice) -> bool:
        return self.total == other.total and self.first <= other.first and other.end <= self.end

    def __str__(self) -> str:
        return f"heads [{self.first}, {self.end}) of {self.total}"


@dataclass(frozen=True)
class TransferHeader:
    """Precedes the pages of one transfer. `note` is opaque bytes here: the caller's own message about
    the transfer (the worker puts its typed handoff note there), carried as is. `heads`: which of the
    model's KV heads the pages hold (None: all of them, `spec.num_kv_heads`)."""

    transfer_id: str
    lease_id: str
    spec: PageSpec
    dest_block_ids: tuple[int, ...]
    note: bytes = b""
    heads: HeadSlice | None = None

    def __post_init__(self) -> None:
        for name in ("transfer_id", "lease_id"):
            if not isinstance(getattr(self, name), str):
                raise PageFormatError(f"{name} must be a str, got {getattr(self, name)!r}")
        if not isinstance(self.spec, PageSpec):
            raise PageFormatError(f"spec must be a PageSpec, got {type(self.spec).__name__}")
        if not isinstance(self.dest_block_ids, (tuple, list)) or not self.dest_block_ids:
            raise PageFormatError(
                f"dest_block_ids must be a non-empty sequence of block ids, got {self.dest_block_ids!r}")
        for b in self.dest_block_ids:
            if isinstance(b, bool) or not isinstance(b, int) or b < 0:
                raise PageFormatError(f"dest_block_ids must hold non-negative ints, got {b!r}")
        object.__setattr__(self, "dest_block_ids", tuple(self.dest_block_ids))
        if not isinstance(self.note, bytes):
            raise PageFormatError(f"note must be bytes, got {type(self.note).__name__}")
        if self.heads is None:
            object.__setattr__(self, "heads", HeadSlice.whole(self.spec.num_kv_heads))
        if not isinstance(self.heads, HeadSlice) or self.heads.count != self.spec.num_kv_heads:
            raise PageFormatError(f"transfer {self.transfer_id}: heads {self.heads} do not match the pages' "
                                  f"{self.spec.num_kv_heads} KV heads")

    @property
    def num_blocks(self) -> int:
        return len(self.dest_block_ids)


def encode_header(header: TransferHeader) -> bytes:
    s = header.spec
    try:
        return msgpack.packb({
            "v": HEADER_VERSION, "transfer_id": header.transfer_id, "lease_id": header.lease_id,
            "spec": [s.dtype, s.block_size, s.num_layers, s.num_kv_heads, s.head_dim],
            "dest_block_ids": list(header.dest_block_ids), "note": header.note,
            "heads": [header.heads.first, header.heads.total],
        }, use_bin_type=True)
    except (TypeError, ValueError, OverflowError) as e:
        raise PageFormatError(f"transfer {header.transfer_id}: header is not msgpack-able: {e}") from e


def decode_header(data: bytes | memoryview) -> TransferHeader:
    """Raises PageFormatError for anything that is not a header this build can read."""
    try:
        msg = msgpack.unpackb(data, raw=False, strict_map_key=True)
    except Exception as e:  # msgpack raises several unrelated types for bad bytes
        raise PageFormatError(f"malformed transfer header: not msgpack ({type(e).__name__}: {e})") from e
    if not isinstance(msg, dict):
        raise PageFormatError(f"malformed transfer header: expected a map, got {type(msg).__name__}")
    if msg.get("v") != HEADER_VERSION:
        raise PageFormatError(
            f"unsupported transfer header version {msg.get('v')!r}; this build reads {HEADER_VERSION}")
    if set(msg) != _HEADER_KEYS:
        raise PageFormatError(f"malformed transfer header: keys {sorted(msg)}, expected {sorted(_HEADER_KEYS)}")
    spec = msg["spec"]
    if not isinstance(spec, list) or len(spec) != 5:
        raise PageFormatError(f"malformed transfer header: spec {spec!r} is not [dtype, block_size, num_layers, "
                              "num_kv_heads, head_dim]")
    heads = msg["heads"]
    if not isinstance(heads, list) or len(heads) != 2:
        raise PageFormatError(f"malformed transfer header: heads {heads!r} is not [first_head, total_kv_heads]")
    spec = PageSpec(*spec)
    return TransferHeader(msg["transfer_id"], msg["lease_id"], spec, msg["dest_block_ids"], msg["note"],
                          HeadSlice(heads[0], spec.num_kv_heads, heads[1]))
