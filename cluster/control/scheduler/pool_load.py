"""What the autoscaler reads of a pool, as the scheduler (or its shards together) sees it now.

Queued prompts are counted in seconds of work at the pool's measured per-token prefill cost, so one
threshold fits a small model on a CPU and a large one on a GPU alike. KV use is what admission has
committed to requests in flight (prompt + max_tokens each), the quantity that makes requests wait.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class PoolLoad:
    role: str  # prefill | decode | colocated
    workers: int  # taking new work (draining ones left out)
    queued_prefill_s: float  # prompts queued on the pool's workers, seconds of work summed over them
    kv_committed: int  # blocks committed to requests in flight
    kv_blocks: int  # blocks of the pool's workers
    waiting: int  # requests waiting for KV room in this pool

    @property
    def queue_s_per_worker(self) -> float:
        return self.queued_prefill_s / max(self.workers, 1)

    @property
    def kv_used(self) -> float:
        return self.kv_committed / self.kv_blocks if self.kv_blocks else 0.0


def merged(shards: list[tuple[PoolLoad, ...]]) -> dict[str, PoolLoad]:
    """One load per pool from every scheduler shard's share of it."""
    out: dict[str, PoolLoad] = {}
    for loads in shards:
        for load in loads:
            seen = out.get(load.role)
            out[load.role] = load if seen is None else PoolLoad(
                load.role, seen.workers + load.workers, seen.queued_prefill_s + load.queued_prefill_s,
                seen.kv_committed + load.kv_committed, seen.kv_blocks + load.kv_blocks, seen.waiting + load.waiting)
    return out


def pool_loads(registry, table, roles: tuple[str, ...], kv_pool: str, waiting: int,
               typical_cost: Callable[[str], float]) -> tuple[PoolLoad, ...]:
    """The loads of `roles` from the scheduler's registry and request table; the requests `waiting` for
    admission wait for KV room in `kv_pool`; `typical_cost(role)` prices a worker's prompts until it has
    measured its own cost."""
    loads = []
    for role in roles:
        views = registry.views(role)
        queued_s = sum(v.queued_prefill_tokens * (v.prefill_s_per_token or typical_cost(role)) for v in views)
        loads.append(PoolLoad(role, len(views), queued_s, sum(table.committed(v.worker_id) for v in views),
                              sum(v.num_blocks for v in views), waiting if role == kv_pool else 0))
    return tuple(loads)
