"""Workers kept in order of a key that changes as they work (their queued prefill, their free KV), so
that routing reads the best few in O(k log n) instead of scanning every worker per request.

A lazy heap: changing a key pushes a new entry and leaves the old one behind, stale; reading skips
stale entries, and the heap is rebuilt when stale entries outnumber live ones.
"""

from __future__ import annotations

import heapq


class WorkerOrder:
    def __init__(self) -> None:
        self._heap: list[tuple[float, str]] = []
        self._keys: dict[str, float] = {}

    def __len__(self) -> int:
        return len(self._keys)

    def set(self, worker_id: str, key: float) -> None:
        if self._keys.get(worker_id) == key:
            return
        self._keys[worker_id] = key
        heapq.heappush(self._heap, (key, worker_id))
        if len(self._heap) > 4 * len(self._keys) + 64:
            self._heap = [(k, w) for w, k in self._keys.items()]
            heapq.heapify(self._heap)

    def discard(self, worker_id: str) -> None:
        self._keys.pop(worker_id, None)

    def best(self, k: int) -> list[str]:
        """The `k` workers with the smallest keys, smallest first (ties by worker id)."""
        taken: list[tuple[float, str]] = []
        seen: set[str] = set()
        while self._heap and len(taken) < k:
            key, wid = heapq.heappop(self._heap)
            if self._keys.get(wid) == key and wid not in seen:
                seen.add(wid)
                taken.append((key, wid))
        for entry in taken:
            heapq.heappush(self._heap, entry)
        return [wid for _, wid in taken]

    def check_integrity(self) -> None:
        live = {wid for key, wid in self._heap if self._keys.get(wid) == key}
        if live != set(self._keys):
            raise RuntimeError(f"worker order: {len(set(self._keys) - live)} workers have no entry of their key")
