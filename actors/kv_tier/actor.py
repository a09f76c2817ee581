"""The node's host KV tier as a Ray actor: one per node, named after its node (`tier_name`), started by the
cluster launch when `kv_tier.host_bytes` > 0. It owns the tier's shared-memory segment and its bookkeeping
(kv_transfer/host_tier.py) and forwards each call to them, one at a time; workers of the node attach to it
(actors/worker/tier_link.py) and move the bytes through the segment themselves.

It outlives every worker of its node. If it dies, the workers notice at their next call and go on without a
tier (their own prefix caches only); its segment's name is swept as a dead creator's (shm_segment.py), and
its memory is freed when the last worker unmaps it.
"""

from __future__ import annotations

from collections.abc import Sequence

from kv_transfer.host_tier import HostTierPool, TierBlock, TierLayout, TierStats
from kv_transfer.page_format import PageSpec

TIER_PREFIX = "tandem-kv-tier-"


def tier_name(node_id: str) -> str:
    return TIER_PREFIX + node_id


class KVTierActor:
    def __init__(self, host_bytes: int):
        self._pool = HostTierPool(host_bytes)

    def attach(self, spec: PageSpec, worker: str, client: str) -> TierLayout:
        return self._pool.attach(spec, worker, client)

    def lease(self, client: str, n: int) -> list[int]:
        return self._pool.lease(client, n)

    def commit(self, client: str, blocks: Sequence[TierBlock]) -> int:
        return self._pool.commit(client, blocks)

    def give_back(self, client: str, slots: Sequence[int]) -> None:
        self._pool.give_back(client, slots)

    def forget(self, client: str) -> None:
        self._pool.forget(client)

    def pin(self, client: str, hashes: Sequence[int], token_ids: Sequence[Sequence[int]]) -> list[int]:
        return self._pool.pin(client, hashes, token_ids)

    def unpin(self, client: str, slots: Sequence[int], loaded: bool) -> None:
        self._pool.unpin(client, slots, loaded)

    def stats(self) -> TierStats:
        return self._pool.stats()

    def check_integrity(self) -> TierStats:
        return self._pool.check_integrity()

    def shutdown(self) -> None:
        self._pool.close()
