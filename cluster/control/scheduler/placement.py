"""Placement: where one request goes, decided from the scheduler's current view with no await inside.

Admission (a decode or colocated worker with room for prompt + max_tokens x n, counting only KV not
committed to requests in flight), cache-aware prefill routing (cluster/control/scheduler/routing.py), and load
shedding on the predicted time to first token (cluster/control/scheduler/ttft_guard.py). The scheduler carries a
`Placement` out; whatever it awaits meanwhile, it checks the plan's workers are still the same before
it commits (`still_valid`).

Per request it weighs every worker of a small pool (up to `CANDIDATES`), as the policies in routing.py
define; in a bigger pool only the candidates: the least-loaded prefill workers and the decode workers
with the most uncommitted KV (kept in order as reports and commitments change, worker_order.py), and the
workers holding the deepest cached prefix of the prompt (prefix_index.py). So a decision costs the same
at 16 workers as at 512. Whether any decode worker has room is still exact: the one with the most
uncommitted KV is always a candidate.

A request with an affinity key (`prompt_cache_key`) prefers the workers the key's last request was placed
on (affinity.py, owned here: placing is what writes it), as routing.py's `prefer_affine` and `pick_decode`
decide.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass

from actors.protocol.messages import GenerateRequest, Rejected
from cluster.control.scheduler.affinity import AffinityMap, Served
from cluster.control.scheduler.link_costs import LinkCosts
from cluster.control.scheduler.prefix_index import PrefixIndex
from cluster.control.scheduler.registry import WorkerRegistry
from cluster.control.scheduler.request_table import RequestTable
from cluster.control.scheduler.routing import (
    ANY_TENANT, PrefillPlan, RecentTenants, WorkerView, pick_decode, plan_prefill, predicted_ttft, prefer_affine,
)
from cluster.control.scheduler.scheduler_state import SchedulerSettings
from cluster.control.scheduler.ttft_guard import TtftGuard
from cluster.control.scheduler.worker_order import WorkerOrder

CANDIDATES = 16  # a pool this small is weighed whole, per request
SAMPLED = 8  # in a bigger one: the best this many by load or room, and as many deepest prefix holders


@dataclass(frozen=True)
class Placement:
    decode_id: str  # the decode (or colocated) worker whose KV the request commits
    prefill: PrefillPlan | None  # None: no routing decision to check (a migration or n > 1 runs locally)
    local: bool  # the whole request runs on `decode_id`
    incarnations: tuple[tuple[str, str], ...]  # (worker id, incarnation) of every worker the plan names

    @property
    def prefill_id(self) -> str:
        return self.decode_id if self.local else self.prefill.worker_id


class Placer:
    def __init__(self, settings: SchedulerSettings, registry: WorkerRegistry, table: RequestTable,
                 index: PrefixIndex, guard: TtftGuard, links: LinkCosts):
        self.s = settings
        self._registry, self._table, self._index, self._guard, self._links = registry, table, index, guard, links
        self._turn = itertools.count()
        self.shed = 0
        self._queued = WorkerOrder()  # prefill (and colocated) workers, least queued prompt tokens first
        self._room = WorkerOrder()  # decode (and colocated) workers, most uncommitted KV first
        self._tenants = RecentTenants()  # overflow prefill only while one tenant is served
        self.affinity = AffinityMap()  # where each affinity key's last request went

    def refresh(self, worker_id: str) -> None:
        """A worker's load, room or standing changed (the registry's and the table's `on_change`, wired by
        their owner): its place in the orders follows."""
        entry = self._registry.get(worker_id)
        view = None if entry is None else self._registry.view(entry.view.role, worker_id)
        if view is None:  # gone, or draining
            self._queued.discard(worker_id)
            self._room.discard(worker_id)
            self.affinity.forget(worker_id)
            return
        if view.role != "decode":
            self._queued.set(worker_id, view.queued_prefill_tokens)
        if view.role != "prefill":
            self._room.set(worker_id, self._table.committed(worker_id) - view.num_blocks)

    @property
    def pool(self) -> str:
        """The role whose KV a request commits: decode, or colocated."""
        return "colocated" if self.s.mode == "colocated" else "decode"

    def blocks_needed(self, request: GenerateRequest) -> int:
        params = request.params
        tokens = len(request.prompt_token_ids)
        tokens += params.max_tokens * params.n if self.s.reserve == "prompt_plus_max_tokens" else 1
        return -(-tokens // self.s.block_size)

    def place(self, request: GenerateRequest, hashes: list[int], blocks_needed: int,
              arrived: float) -> Placement | Rejected | None:
        """A placement, a rejection (shed), or None: no worker has room now (try again later)."""
        prompt_len = len(request.prompt_token_ids)
        # Where the batchers take tenants in turn, another tenant's queue counts only in part (routing.py).
        tenant = request.cache_salt if self.s.tenant_turns else ANY_TENANT
        now = time.monotonic()
        self._tenants.saw(tenant, now)
        overflow_s = self.s.local_prefill_overflow_s if self._tenants.alone(tenant, now) else None
        key = None if request.affinity is None else (request.cache_salt, request.affinity)
        served = None if key is None else self.affinity.get(key)
        if self.s.mode == "colocated":
            fits = [v for v in self._with_room("colocated", hashes) if v.free_blocks >= blocks_needed]
            if not fits:
                return None
            cached, cost = self._cached(fits, hashes), self.typical_cost("colocated")
            plan = plan_prefill(self.s.routing, fits, cached, prompt_len, 0.0, cost, next(self._turn), tenant=tenant)
            if served is not None:
                affine = next((v for v in fits if v.worker_id == served.decode_id), None)
                plan = prefer_affine(plan, affine, True, fits, cached, prompt_len, cost, 0.0, tenant)
            return self._shed(plan, arrived) or self._placement(plan.worker_id, plan, local=True, key=key)

        decode = pick_decode(self._with_room("decode", ()), blocks_needed,
                             prefer=served.decode_id if served is not None else None)
        if decode is None:
            return None
        prefill_pool = self._prefill_candidates(hashes)
        cached = self._cached(prefill_pool + [decode], hashes)
        if prefill_pool:
            # Whole blocks travel, cached or not: the decode worker has none of them.
            info = self._registry.get(decode.worker_id).info
            nbytes = -(-prompt_len // info.block_size) * info.block_size * info.kv_bytes_per_token
            transfer_s = {p.worker_id: self._links.seconds(p.worker_id, decode.worker_id, nbytes)
                          for p in prefill_pool}
            local_ok = self.s.local_prefill
            plan = plan_prefill(self.s.routing, prefill_pool, cached, prompt_len, transfer_s,
                                self.typical_cost("prefill"), next(self._turn),
                                local=decode if local_ok else None, local_penalty=self.s.local_prefill_penalty,
                                local_max_tokens=self.s.local_prefill_max_tokens, tenant=tenant,
                                local_overflow_s=overflow_s, step_tokens=self.s.step_tokens)
            if served is not None:
                plan = self._affine_prefill(plan, served, prefill_pool, decode, cached, prompt_len, transfer_s, tenant)
        else:
            cost = predicted_ttft(decode, prompt_len, cached[decode.worker_id], self.typical_cost("decode"), 0.0,
                                  tenant)
            plan = PrefillPlan(decode.worker_id, True, cached[decode.worker_id], cost)
        shed = self._shed(plan, arrived)
        if shed is not None:
            return shed
        if plan.local:
            return self._placement(decode.worker_id, plan, local=True, key=key)
        if request.params.n > 1 or request.output_prefix:
            # Samples fork from one prefilled prompt, and a migration recomputes its output: both run whole.
            return self._placement(decode.worker_id, None, local=True, key=key)
        return self._placement(decode.worker_id, plan, local=False, key=key)

    def _affine_prefill(self, plan: PrefillPlan, served: Served, prefill_pool: list[WorkerView], decode: WorkerView,
                        cached: dict[str, int], prompt_len: int, transfer_s: dict[str, float],
                        tenant: object) -> PrefillPlan:
        """`plan`, or the prefill worker the request's affinity key last went to (routing.py `prefer_affine`):
        a prefill worker, or the chosen decode worker where it prefilled the key's last prompt itself and may
        prefill this one (local prefill on, the uncached part within its cap)."""
        affine = next((v for v in prefill_pool if v.worker_id == served.prefill_id), None)
        if affine is not None:
            return prefer_affine(plan, affine, False, prefill_pool, cached, prompt_len, self.typical_cost("prefill"),
                                 transfer_s[affine.worker_id], tenant)
        cap = self.s.local_prefill_max_tokens
        if (served.prefill_id == decode.worker_id and self.s.local_prefill
                and (cap is None or prompt_len - cached[decode.worker_id] <= cap)):
            return prefer_affine(plan, decode, True, prefill_pool, cached, prompt_len, self.typical_cost("prefill"),
                                 0.0, tenant)
        return plan

    def still_valid(self, placement: Placement) -> bool:
        """Every worker the plan names is still registered as the same process and takes work."""
        return all(self._registry.is_current(wid, inc) and not self._registry.is_draining(wid)
                   for wid, inc in placement.incarnations)

    def _with_room(self, role: str, hashes: list[int]) -> list[WorkerView]:
        """The role's candidates (every worker of a small pool), with `free_blocks` = KV not committed to
        requests in flight.

        Admission commits prompt + max_tokens x n per request (policy `prompt_plus_max_tokens`), so a
        request admitted now can always finish; the workers' own free counts lag and include cache."""
        if self._registry.pool_size(role) <= CANDIDATES:
            views = self._registry.views(role)
        else:
            ids = self._room.best(SAMPLED) + self._index.deepest_holders(hashes, SAMPLED)
            if role == "colocated":  # it prefills too: the least loaded are candidates as well
                ids += self._queued.best(SAMPLED)
            views = [v for wid in dict.fromkeys(ids) if (v := self._registry.view(role, wid)) is not None]
        committed = self._table.committed
        return [WorkerView(v.worker_id, v.role, v.num_blocks - committed(v.worker_id), v.num_blocks,
                           v.queued_prefill_tokens, v.running, v.waiting, v.prefill_s_per_token, v.queued_by_tenant)
                for v in views]

    def _prefill_candidates(self, hashes: list[int]) -> list[WorkerView]:
        if self._registry.pool_size("prefill") <= CANDIDATES:
            return self._registry.views("prefill")
        ids = self._queued.best(SAMPLED) + self._index.deepest_holders(hashes, SAMPLED)
        return [v for wid in dict.fromkeys(ids) if (v := self._registry.view("prefill", wid)) is not None]

    def typical_cost(self, role: str) -> float:
        """Per-token prefill cost for a worker not measured yet: its pool's mean, else the configured one.

        Workers of one pool run the same model on the same hardware, so a fresh worker is as fast as
        its measured peers; a pessimistic guess would keep all traffic on the first measured worker."""
        measured = self._registry.mean_prefill_cost(role)
        return measured if measured is not None else self.s.prefill_s_per_token

    def check_integrity(self) -> None:
        self._queued.check_integrity()
        self._room.check_integrity()
        self.affinity.check_integrity()
        taking = set(self._registry.ids()) - set(self._registry.draining())
        if not self.affinity.workers() <= taking:
            raise RuntimeError(f"affinity keys name workers {sorted(self.affinity.workers() - taking)} that take no work")

    def best_ttft_s(self, prompt_len: int) -> float:
        """The TTFT the guard would predict for an uncached prompt of `prompt_len` tokens placed now on the
        best worker to prefill it (a prefill worker, or a decode worker with the most room prefilling it
        itself, by the same rule as `place`): the least a request admitted now waits for its first token.
        0 when no worker could prefill it."""
        if self.s.mode == "colocated":
            views = [v for wid in self._queued.best(SAMPLED) if (v := self._registry.view("colocated", wid))]
            local = None
        else:
            views = self._prefill_candidates([])
            room = self._room.best(1) if self.s.local_prefill else []
            local = self._registry.view("decode", room[0]) if room else None
        if not views and local is None:
            return 0.0
        if not views:
            views, local = [local], None
        plan = plan_prefill("cache_aware", views, {}, prompt_len, 0.0, self.typical_cost(views[0].role), 0,
                            local=local, local_penalty=self.s.local_prefill_penalty,
                            local_max_tokens=self.s.local_prefill_max_tokens,
                            local_overflow_s=self.s.local_prefill_overflow_s
                            if self._tenants.at_most_one(time.monotonic()) else None)
        return self._guard.calibrated(plan.worker_id, self._guard.predict(plan, self.step_s(plan.worker_id)))

    def hopeless(self, arrived: float, prompt_len: int) -> Rejected | None:
        """A refusal, now rather than at its deadline, for a request waiting for KV room since `arrived` that
        would miss the TTFT limit even if room freed this moment (its wait so far + the best predicted TTFT)."""
        waited_s, ttft_s = time.monotonic() - arrived, self.best_ttft_s(prompt_len)
        limit = self._guard.limit_s
        if limit is None or waited_s + ttft_s <= limit:
            return None
        return Rejected(f"overloaded: waited {waited_s:.1f}s for KV room, and its first token would take "
                        f"~{ttft_s:.1f}s more: past the {limit:.1f}s limit ({self._guard.setting})", self.retry_after_s())

    def retry_after_s(self) -> float:
        # Room frees as running requests finish: estimate from the queued prefill work on the pool.
        views = self._registry.views(self.pool)
        return max(1.0, sum(v.queued_prefill_tokens for v in views) * self.typical_cost(self.pool))

    def step_s(self, worker_id: str) -> float | None:
        entry = self._registry.get(worker_id)
        return entry.stats.step_s if entry is not None and entry.stats is not None else None

    def _cached(self, views: list[WorkerView], hashes: list[int]) -> dict[str, int]:
        return {v.worker_id: self._index.cached_blocks(v.worker_id, hashes) * self.s.block_size for v in views}

    def _placement(self, decode_id: str, plan: PrefillPlan | None, local: bool,
                   key: tuple[str | None, str] | None) -> Placement:
        if key is not None:  # remembered as placed: a request of the key placed while this one is carried out follows it
            self.affinity.served(key, decode_id if plan is None else plan.worker_id, decode_id)
        names = {decode_id} | ({plan.worker_id} if plan is not None else set())
        incarnations = tuple((wid, self._registry.get(wid).info.incarnation) for wid in sorted(names))
        return Placement(decode_id, plan, local, incarnations)

    def _shed(self, plan: PrefillPlan, arrived: float) -> Rejected | None:
        """Reject now (429) a request that would miss the TTFT target anyway: admitting it would only
        make every request behind it later too."""
        view = self._registry.get(plan.worker_id).view
        queue_ahead = view.queued_prefill_tokens > 0 or view.running > 0
        ttft = self._guard.overshoot(plan, self.step_s(plan.worker_id), time.monotonic() - arrived, queue_ahead)
        if ttft is None:
            return None
        self.shed += 1
        limit = self._guard.limit_s
        return Rejected(f"overloaded: predicted time to first token {ttft:.2f}s exceeds the {limit:.2f}s limit "
                        f"({self._guard.setting})",
                        max(1.0, ttft - limit))

