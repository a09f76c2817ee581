"""Which worker holds which prefix blocks: the global view, fed by the workers' KV events.

Hashes come from `actors.engine.kv.block_hash` (salted by tenant and model), the same function the workers'
block pools use, so a hash here means the same tokens there.
"""

from __future__ import annotations

import itertools
from collections import defaultdict

from actors.protocol.kv_events import AllCleared, BlockRemoved, BlockStored


class PrefixIndex:
    def __init__(self) -> None:
        self._holders: dict[int, set[str]] = defaultdict(set)
        self._by_worker: dict[str, set[int]] = defaultdict(set)

    def apply(self, worker_id: str, events: list) -> None:
        for e in events:
            if isinstance(e, BlockStored):
                self._holders[e.block_hash].add(worker_id)
                self._by_worker[worker_id].add(e.block_hash)
            elif isinstance(e, BlockRemoved):
                self._discard(worker_id, e.block_hash)
            elif isinstance(e, AllCleared):
                self.forget(worker_id)

    def forget(self, worker_id: str) -> None:
        for h in list(self._by_worker.pop(worker_id, ())):
            self._discard(worker_id, h)

    def cached_blocks(self, worker_id: str, block_hashes: list[int]) -> int:
        """Length of the longest prefix of `block_hashes` this worker holds."""
        n = 0
        for h in block_hashes:
            if worker_id not in self._holders.get(h, ()):
                break
            n += 1
        return n

    def size(self) -> int:
        """(block hash, worker) pairs held."""
        return sum(len(v) for v in self._by_worker.values())

    def deepest_holders(self, block_hashes: list[int], k: int) -> list[str]:
        """Up to `k` workers holding the deepest block of `block_hashes` that any worker holds: the ones
        with the longest cached prefix, found in O(blocks) whatever the number of workers."""
        for h in reversed(block_hashes):
            holders = self._holders.get(h)
            if holders:
                return list(itertools.islice(holders, k))
        return []

    def _discard(self, worker_id: str, block_hash: int) -> None:
        holders = self._holders.get(block_hash)
        if holders is not None:
            holders.discard(worker_id)
            if not holders:
                del self._holders[block_hash]
        self._by_worker[worker_id].discard(block_hash)

    def check_integrity(self) -> None:
        pairs = sum(len(v) for v in self._holders.values())
        back = sum(len(v) for v in self._by_worker.values())
        if pairs != back:
            raise RuntimeError(f"prefix index: {pairs} (hash, worker) pairs but {back} reverse entries")
