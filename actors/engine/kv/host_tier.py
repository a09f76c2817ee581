"""The engine's view of a second KV tier below its block pool (the node's host tier): the contract only.

The engine knows no Ray; the worker gives its `KVCacheManager` an object with these methods
(`attach_tier`), and the manager calls them on the engine's step thread:
- `offer(evicted)`: blocks the pool is evicting right now, before their new owner writes them. The tier
  must copy their bytes before it returns (later is too late) and do the rest (publishing them) off this
  thread; it may drop blocks (a full queue, a tier gone) but never block on another process.
- `find(hashes, token_ids)`: the leading run of these blocks (hash AND tokens equal) the tier holds, as
  opaque handles it keeps from being evicted until `done`. [] when it has none or cannot answer.
- `load(handles, block_ids)`: copy those blocks into the given blocks of the pool, bit for bit; raises if it
  could not (the blocks' contents are then undefined and the caller frees them uncached).
- `done(handles, loaded)`: the caller is through with them (whether it loaded them).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence


@dataclass(frozen=True, slots=True)
class EvictedBlock:
    block_id: int
    block_hash: int
    token_ids: tuple[int, ...]


class HostTier(Protocol):
    def offer(self, evicted: Sequence[EvictedBlock]) -> None: ...

    def find(self, hashes: Sequence[int], token_ids: Sequence[Sequence[int]]) -> list[int]: ...

    def load(self, handles: Sequence[int], block_ids: Sequence[int]) -> None: ...

    def done(self, handles: Sequence[int], loaded: bool) -> None: ...
