"""KV events: what a worker's block pool tells the global prefix index about its cached blocks."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class BlockStored:
    """A full block is now in the prefix cache under `block_hash`."""

    block_hash: int
    parent_hash: int | None  # None: first block of its sequence
    num_tokens: int


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """The block cached under `block_hash` was evicted; the hash no longer hits on this worker."""

    block_hash: int


@dataclass(frozen=True, slots=True)
class AllCleared:
    """Every cached hash on this worker was dropped (`reset_prefix_cache`)."""


KVEvent = BlockStored | BlockRemoved | AllCleared
