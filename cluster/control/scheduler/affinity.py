"""Affinity keys: which workers last served a request with the same (tenant, `prompt_cache_key`).

OpenAI's `prompt_cache_key` names requests that share a long prefix (one conversation, one agent's
instructions); the ingress carries it as `GenerateRequest.affinity`. The prefix index (prefix_index.py)
only knows blocks a worker has reported, and only whole blocks: a conversation's next turn that arrives
before the previous one's blocks are reported, or whose shared prefix is shorter than a block, has no hit
there, and load alone would spread it. This map remembers where the key went last, so routing
(routing.py `prefer_affine`, placement.py) can send the next request there.

Bounded: the `capacity` most recently used keys (LRU); a key is a hint, so forgetting one costs a cache
miss, never a wrong answer. Keys are per tenant (the cache salt), so one tenant's key never steers
another's requests. A worker that leaves (lost, removed, draining) is forgotten with every key naming it.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

CAPACITY = 65_536  # keys remembered; the least recently used is dropped past this

AffinityKey = tuple[str | None, str]  # (cache salt, prompt_cache_key)


@dataclass(frozen=True)
class Served:
    """Where the key's last request went."""

    prefill_id: str  # the worker that computed its prompt (a decode worker, if it prefilled locally)
    decode_id: str  # the worker whose KV holds the whole request


class AffinityMap:
    def __init__(self, capacity: int = CAPACITY):
        if capacity < 1:
            raise ValueError(f"an affinity map holds at least one key, not {capacity}")
        self.capacity = capacity
        self._last: OrderedDict[AffinityKey, Served] = OrderedDict()
        self._by_worker: dict[str, set[AffinityKey]] = {}  # worker id -> keys whose entry names it

    def get(self, key: AffinityKey) -> Served | None:
        served = self._last.get(key)
        if served is not None:
            self._last.move_to_end(key)
        return served

    def served(self, key: AffinityKey, prefill_id: str, decode_id: str) -> None:
        """The key's request was placed on these workers: its next one prefers them."""
        self._drop(key)
        self._last[key] = entry = Served(prefill_id, decode_id)
        for worker_id in {entry.prefill_id, entry.decode_id}:
            self._by_worker.setdefault(worker_id, set()).add(key)
        while len(self._last) > self.capacity:
            self._drop(next(iter(self._last)))

    def forget(self, worker_id: str) -> None:
        """The worker left: no key prefers it any more."""
        for key in list(self._by_worker.get(worker_id, ())):
            self._drop(key)

    def __len__(self) -> int:
        return len(self._last)

    def workers(self) -> set[str]:
        return set(self._by_worker)

    def _drop(self, key: AffinityKey) -> None:
        entry = self._last.pop(key, None)
        if entry is None:
            return
        for worker_id in {entry.prefill_id, entry.decode_id}:
            keys = self._by_worker[worker_id]
            keys.discard(key)
            if not keys:
                del self._by_worker[worker_id]

    def check_integrity(self) -> None:
        back = {(wid, key) for wid, keys in self._by_worker.items() for key in keys}
        forward = {(wid, key) for key, e in self._last.items() for wid in (e.prefill_id, e.decode_id)}
        if len(self._last) > self.capacity or back != forward:
            raise RuntimeError(f"affinity map: {len(self._last)} keys (capacity {self.capacity}), {len(forward)} "
                               f"(worker, key) pairs but {len(back)} reverse entries")
