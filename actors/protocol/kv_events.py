"""KV events: what a worker's block pool tells the global prefix index about its cached blocks.

Tagged msgspec structs: they travel inside a worker's report over zmq (scheduler_wire.py), where a
union of plain dataclasses could not be told apart.
"""

from __future__ import annotations

import msgspec


class BlockStored(msgspec.Struct, frozen=True, tag=True):
    """A full block is now in the prefix cache under `block_hash`."""

    block_hash: int
    parent_hash: int | None  # None: first block of its sequence
    num_tokens: int


class BlockRemoved(msgspec.Struct, frozen=True, tag=True):
    """The block cached under `block_hash` was evicted; the hash no longer hits on this worker."""

    block_hash: int


class AllCleared(msgspec.Struct, frozen=True, tag=True):
    """Every cached hash on this worker was dropped (`reset_prefix_cache`)."""


KVEvent = BlockStored | BlockRemoved | AllCleared
