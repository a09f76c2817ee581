"""Tenant shares: one tenant cannot hold more than its share of the pool's KV, nor of the admission queue.

A request carries its tenant (`cache_salt`) and that tenant's share (`kv_share`, set by the ingress
from its config). Admission counts the KV already committed to the tenant's requests in flight
(`RequestTable.tenant_committed`): a request that would push its tenant past its share waits in the
queue like one that finds no room, and a tenant may fill only its share of the queue, so a flood from
one tenant is refused at once (429) instead of standing in front of everyone else's requests.
"""

from __future__ import annotations

from actors.protocol.messages import GenerateRequest, Rejected
from cluster.control.scheduler.registry import WorkerRegistry
from cluster.control.scheduler.request_table import RequestTable


class TenantShares:
    def __init__(self, table: RequestTable, registry: WorkerRegistry, max_queued: int):
        self._table, self._registry, self._max_queued = table, registry, max_queued
        self._queued: dict[str | None, int] = {}  # cache salt -> its requests waiting for admission

    def kv_limit(self, request: GenerateRequest, pool: str) -> int | None:
        """The most KV blocks the request's tenant may hold on `pool` (None: no limit)."""
        pool_blocks = self._registry.pool_blocks(pool)
        if request.kv_share is None or not pool_blocks:
            return None  # no workers yet: admission waits for them, and then knows the share
        return int(request.kv_share * pool_blocks)

    def too_big(self, request: GenerateRequest, blocks_needed: int, pool: str) -> Rejected | None:
        """A request that alone is bigger than its tenant's share can never be admitted (a 400)."""
        limit = self.kv_limit(request, pool)
        if limit is None or blocks_needed <= limit:
            return None
        return Rejected(f"the request needs {blocks_needed} KV blocks (prompt + max_tokens x n); its tenant's share "
                        f"of the {pool} pool is {limit}: lower max_tokens or n", None)

    def fits(self, request: GenerateRequest, blocks_needed: int, pool: str) -> bool:
        limit = self.kv_limit(request, pool)
        return limit is None or self._table.tenant_committed(request.cache_salt) + blocks_needed <= limit

    def over_share(self, request: GenerateRequest, blocks_needed: int, pool: str, retry_after_s: float) -> Rejected:
        """Why a request that waited its whole admission deadline still does not fit its tenant's share."""
        held = self._table.tenant_committed(request.cache_salt)
        return Rejected(f"tenant {request.cache_salt!r} holds {held} KV blocks of its share of "
                        f"{self.kv_limit(request, pool)} ({request.kv_share:.0%} of the {pool} pool); this request "
                        f"needs {blocks_needed} more", retry_after_s)

    def enter_queue(self, request: GenerateRequest) -> Rejected | None:
        """Take a queue slot for the request, or refuse it: its tenant already fills its share of the queue."""
        tenant = request.cache_salt
        waiting = self._queued.get(tenant, 0)
        # A migration continues a request admitted before: refusing it would fail a running stream.
        capped = request.kv_share is not None and not request.output_prefix
        if capped and waiting >= max(1, int(request.kv_share * self._max_queued)):
            return Rejected(f"tenant {tenant!r} has {waiting} requests waiting for admission, its share of the "
                            "queue", 1.0)
        self._queued[tenant] = waiting + 1
        return None

    def leave_queue(self, request: GenerateRequest) -> None:
        tenant = request.cache_salt
        self._queued[tenant] -= 1
        if not self._queued[tenant]:
            del self._queued[tenant]

    def queued(self) -> int:
        return sum(self._queued.values())

    def check_integrity(self) -> None:
        if any(n <= 0 for n in self._queued.values()):
            raise RuntimeError(f"queued requests by tenant {self._queued} count a tenant with none")
