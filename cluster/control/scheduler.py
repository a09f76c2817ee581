"""The global scheduler actor: worker registry, prefix index, admission, routing, handoff leases.

An async Ray actor: every method runs on one event loop, so its state needs no locks. Workers push
stats, finished requests and KV events to `report`; clients call `submit` and `abort`.

Request path (disaggregated): pick a decode worker that can hold the request (admission), plan the
prefill (cache-aware cost model; possibly local on that decode worker), reserve the prompt's blocks
on the decode worker, then send the prompt to the prefill worker with the destination blocks. When
the decode worker has adopted the pages it calls `handoff_done`, and the prefill worker is told to
release its hold. Every terminal report runs one idempotent reclaim.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import time
import uuid

import ray

from actors.engine.kv.block_hash import hash_prompt_blocks
from actors.protocol.request_status import RequestStatus
from actors.protocol.token_stream import TokenDelta, TokenPublisher
from cluster.control.prefix_index import PrefixIndex
from cluster.control.routing import PrefillPlan, WorkerView, pick_decode, plan_prefill, predicted_ttft
from cluster.control.scheduler_membership import Membership
from cluster.control.scheduler_state import SchedulerSettings, Tracked, WorkerEntry, attempt_of
from cluster.control.ttft_guard import TtftGuard

log = logging.getLogger("tandem.scheduler")
_CALL_TIMEOUT_S = 30.0


class Scheduler(Membership):
    def __init__(self, settings: SchedulerSettings):
        self.s = settings
        self._workers: dict[str, WorkerEntry] = {}
        self._index = PrefixIndex()
        self._requests: dict[str, Tracked] = {}
        self._turn = itertools.count()
        self._queued = 0
        self._committed: dict[str, int] = {}  # worker id -> KV blocks promised to in-flight requests
        self._lost: dict[str, str] = {}  # worker id -> incarnation the watchdog declared dead
        self._draining: set[str] = set()  # workers being removed: no new work, in-flight work finishes
        self._epoch = uuid.uuid4().hex[:6]  # attempt ids stay unique across scheduler restarts
        self._attempts = itertools.count()
        self._guard = TtftGuard(settings.max_predicted_ttft_s)
        self._watchdog: asyncio.Task | None = None
        self._publisher = TokenPublisher()  # only to tell a client its request failed with a lost worker
        self.counters = {"submitted": 0, "rejected": 0, "finished": 0, "failed": 0, "local_prefills": 0,
                         "workers_lost": 0, "rerouted": 0,
                         "shed": 0}

    # ---- workers ----

    async def _resubmit(self, request: dict) -> None:
        answer = await self.submit(request)
        if "rejected" in answer:
            self._tell_client(request, f"could not re-route after a worker loss: {answer['rejected']}")

    def _tell_client(self, request: dict, message: str, retryable: bool = False, wire_id: str | None = None) -> None:
        delta = TokenDelta(wire_id or request["request_id"], 0, 0, [], int(RequestStatus.FAILED),
                           len(request["prompt_token_ids"]), 0, message, retryable=retryable)
        self._publisher.publish(request["sink"], [delta])

    async def report(self, worker_id: str, stats: dict, finished: list, events: list) -> bool:
        """False tells the worker this scheduler does not know it: it registers again."""
        worker = self._workers.get(worker_id)
        if worker is None:
            return False
        worker.last_seen = time.monotonic()
        worker.stats = stats
        v = worker.view
        v.free_blocks, v.num_blocks = stats["free_blocks"], stats["num_blocks"]
        v.running, v.waiting = stats["running"], stats["waiting"]
        v.queued_prefill_tokens = stats["queued_prefill_tokens"]
        v.prefill_s_per_token = stats["prefill_s_per_token"]
        self._index.apply(worker_id, events)
        self._guard.observe(worker_id, stats.get("first_token_waits", ()))
        for wire_id, status in finished:
            self._reclaim(attempt_of(wire_id), wire_id, failed=status >= 14)
        return True

    async def handoff_done(self, wire_id: str, prefill_worker: str | None = None) -> None:
        tracked = self._requests.get(attempt_of(wire_id))
        if tracked is None or tracked.wire_id != wire_id or tracked.prefill is None:
            # Not tracked (this scheduler restarted since): the prefill worker still holds the pages.
            worker = self._workers.get(prefill_worker)
            if worker is not None and worker.view.role == "prefill":
                worker.handle.release.remote(wire_id)
            return
        tracked.handed_off = True
        self._release_prefill(tracked)

    def _release_prefill(self, tracked: Tracked) -> None:
        prefill_id = tracked.prefill.worker_id
        worker = self._workers.get(prefill_id)
        if worker is not None:
            worker.handle.release.remote(tracked.wire_id)
        tracked.workers.discard(prefill_id)

    # ---- requests ----

    async def submit(self, request: dict) -> dict:
        """Admit and route one request; returns {"ok": True} or {"rejected": reason, "retry_after_s": s}."""
        self.counters["submitted"] += 1
        request_id = request["request_id"]
        if request.get("output_prefix") and request_id in self._requests:
            self._reclaim(request_id, None, failed=True)  # a migration: the old attempt's worker is gone
        if request_id in self._requests:
            return self._reject(f"request_id {request_id!r} is already in flight", None)
        if "@" in request_id:
            return self._reject(f"request_id {request_id!r} contains '@', which marks attempts", None)
        if self._queued >= self.s.max_queued:
            return self._reject("the admission queue is full", self._retry_after_s())
        self._queued += 1
        try:
            return await self._admit(request)
        finally:
            self._queued -= 1

    async def _admit(self, request: dict) -> dict:
        prompt = request["prompt_token_ids"]
        arrived = time.monotonic()
        # Waiting for KV room past the TTFT target is pointless too: the request would miss it.
        deadline = arrived + min(self.s.queue_timeout_s, self.s.max_predicted_ttft_s or self.s.queue_timeout_s)
        blocks_needed = self._blocks_needed(request)
        hashes = hash_prompt_blocks(prompt, self.s.block_size, request.get("cache_salt"), self.s.model_id)
        pool = "colocated" if self.s.mode == "colocated" else "decode"
        while True:
            if self._views(pool):
                biggest = max(v.num_blocks for v in self._views(pool))
                if blocks_needed > biggest:
                    return self._reject(f"the request needs {blocks_needed} KV blocks (prompt + max_tokens x n); the "
                                        f"largest {pool} worker has {biggest}: lower max_tokens or n", None)
                placed = await self._place(request, hashes, blocks_needed, arrived)
                if placed is not None:
                    return placed
            if time.monotonic() >= deadline:
                if not self._views(pool):
                    return {**self._reject(f"no {pool} worker is ready", 5.0), "unavailable": True}
                return self._reject("no worker has room for the request's KV", self._retry_after_s())
            await asyncio.sleep(0.01)

    async def _place(self, request: dict, hashes: list[int], blocks_needed: int, arrived: float) -> dict | None:
        request_id = request["request_id"]
        wire = {**request, "request_id": f"{request_id}@{self._epoch}{next(self._attempts)}"}
        prompt_len = len(request["prompt_token_ids"])
        if self.s.mode == "colocated":
            pool = self._views_with_room("colocated")
            cached = {v.worker_id: self._index.cached_blocks(v.worker_id, hashes) * self.s.block_size for v in pool}
            fits = [v for v in pool if v.free_blocks >= blocks_needed]
            if not fits:
                return None
            plan = plan_prefill(self.s.routing, fits, cached, prompt_len, 0.0, self._typical_cost(pool), next(self._turn))
            return self._shed(plan, arrived) or await self._run_local(wire, plan.worker_id, blocks_needed, plan)

        decode = pick_decode(self._views_with_room("decode"), blocks_needed)
        if decode is None:
            return None
        prefill_pool = self._views("prefill")
        candidates = prefill_pool + [decode]
        cached = {v.worker_id: self._index.cached_blocks(v.worker_id, hashes) * self.s.block_size for v in candidates}
        transfer_s = prompt_len * self._workers[decode.worker_id].info["kv_bytes_per_token"] / self.s.transfer_bytes_per_s
        local_ok = self.s.local_prefill or not prefill_pool
        plan = plan_prefill(
            self.s.routing, prefill_pool, cached, prompt_len, transfer_s, self._typical_cost(prefill_pool),
            next(self._turn), local=decode if local_ok else None, local_penalty=self.s.local_prefill_penalty,
        ) if prefill_pool else PrefillPlan(decode.worker_id, True, cached[decode.worker_id], predicted_ttft(
            decode, prompt_len, cached[decode.worker_id], self._typical_cost([decode]), 0.0))
        shed = self._shed(plan, arrived)
        if shed is not None:
            return shed
        if plan.local or request["params"].get("n", 1) > 1 or request.get("output_prefix"):
            self.counters["local_prefills"] += 1
            return await self._run_local(wire, decode.worker_id, blocks_needed, plan if plan.local else None)

        decode_worker = self._workers[decode.worker_id]
        try:
            dest_blocks = await asyncio.wait_for(decode_worker.handle.reserve.remote(wire), _CALL_TIMEOUT_S)
        except (ray.exceptions.RayError, asyncio.TimeoutError) as exc:
            # The worker is dying or restarting: try again (elsewhere) until the admission deadline.
            log.warning("reserve on %s failed: %s", decode.worker_id, exc)
            decode_worker.handle.abort.remote(wire["request_id"])  # in case the reservation landed after all
            return None
        if dest_blocks is None:
            return None
        self._commit(Tracked(request_id, wire["request_id"], {plan.worker_id, decode.worker_id}, plan,
                              decode.worker_id, blocks_needed, request=request))
        dest = {"endpoint": decode_worker.info["kv_endpoint"], "block_ids": dest_blocks, "lease_id": wire["request_id"],
                "decode_worker": decode.worker_id}
        self._guard.expect(wire["request_id"], plan, self._workers[plan.worker_id].stats.get("step_s"))
        self._workers[plan.worker_id].handle.submit.remote({**wire, "dest": dest})
        self._workers[plan.worker_id].view.queued_prefill_tokens += prompt_len - plan.cached_tokens
        return {"ok": True, "prefill": plan.worker_id, "decode": decode.worker_id, "cached_tokens": plan.cached_tokens}

    async def _run_local(self, wire: dict, worker_id: str, blocks_needed: int, plan: PrefillPlan | None = None) -> dict:
        worker = self._workers[worker_id]
        if plan is not None and plan.worker_id == worker_id:
            self._guard.expect(wire["request_id"], plan, worker.stats.get("step_s"))
        worker.view.queued_prefill_tokens += len(wire["prompt_token_ids"])
        request_id = attempt_of(wire["request_id"])
        self._commit(Tracked(request_id, wire["request_id"], {worker_id}, None, worker_id, blocks_needed,
                              request={**wire, "request_id": request_id}))
        worker.handle.submit.remote(wire)
        return {"ok": True, "prefill": worker_id, "decode": worker_id, "local": True}

    async def abort(self, request_id: str) -> bool:
        return self._reclaim(request_id, None, failed=False, cancelled=True)

    def _reclaim(self, request_id: str, wire_id: str | None, failed: bool, cancelled: bool = False,
                 skip: str | None = None) -> bool:
        """Every terminal path ends here; a second call for the same request does nothing, and a report
        about an older attempt (`wire_id`) leaves the current one alone."""
        tracked = self._requests.get(request_id)
        if tracked is None or (wire_id is not None and wire_id != tracked.wire_id):
            return False
        del self._requests[request_id]
        self._guard.forget(tracked.wire_id)
        self._committed[tracked.decode_id] -= tracked.blocks
        for wid in tracked.workers - {skip}:
            worker = self._workers.get(wid)
            if worker is not None:
                worker.handle.abort.remote(tracked.wire_id)  # idempotent on the worker
        self.counters["failed" if failed else "finished"] += 1
        return True

    def _shed(self, plan: PrefillPlan, arrived: float) -> dict | None:
        """Reject now (429) a request that would miss the TTFT target anyway: admitting it would only
        make every request behind it later too."""
        worker = self._workers[plan.worker_id]
        queue_ahead = worker.view.queued_prefill_tokens > 0 or worker.stats.get("running", 0) > 0
        ttft = self._guard.overshoot(plan, worker.stats.get("step_s"), time.monotonic() - arrived, queue_ahead)
        if ttft is None:
            return None
        self.counters["shed"] += 1
        limit = self._guard.limit_s
        return self._reject(f"overloaded: predicted time to first token {ttft:.2f}s exceeds the "
                            f"{limit:.2f}s target", max(1.0, ttft - limit))

    def _blocks_needed(self, request: dict) -> int:
        params = request["params"]
        reserve_tokens = len(request["prompt_token_ids"]) + (params.get("max_tokens", 16) * params.get("n", 1)
                                                             if self.s.reserve == "prompt_plus_max_tokens" else 1)
        return -(-reserve_tokens // self.s.block_size)

    def _reject(self, reason: str, retry_after_s: float | None) -> dict:
        """retry_after_s None: the request can never be admitted as it is (a client error)."""
        self.counters["rejected"] += 1
        return {"rejected": reason, "retry_after_s": retry_after_s}

    def _retry_after_s(self) -> float:
        # Room frees as running requests finish: estimate from the queued prefill work on the decode pool.
        views = self._views("colocated" if self.s.mode == "colocated" else "decode")
        queued = sum(v.queued_prefill_tokens for v in views)
        cost = self._typical_cost(views)
        return max(1.0, queued * cost)

    def _typical_cost(self, pool: list[WorkerView]) -> float:
        """Per-token prefill cost for a worker not measured yet: its pool's mean, else the configured one.

        Workers of one pool run the same model on the same hardware, so a fresh worker is as fast as
        its measured peers; a pessimistic guess would keep all traffic on the first measured worker."""
        measured = [v.prefill_s_per_token for v in pool if v.prefill_s_per_token is not None]
        return sum(measured) / len(measured) if measured else self.s.prefill_s_per_token

    def _commit(self, tracked: Tracked) -> None:
        old = self._requests.get(tracked.request_id)
        if old is not None:
            # Another attempt was tracked while this one awaited its placement (a re-announced stale
            # copy, say): the newest wins, and the old one's KV is released, never overwritten.
            self._reclaim(old.request_id, old.wire_id, failed=True)
        self._requests[tracked.request_id] = tracked
        self._committed[tracked.decode_id] = self._committed.get(tracked.decode_id, 0) + tracked.blocks

    def _views_with_room(self, role: str) -> list[WorkerView]:
        """The role's workers with `free_blocks` = KV not promised to in-flight requests.

        Admission reserves prompt + max_tokens x n per request (policy `prompt_plus_max_tokens`), so a
        request admitted now can always finish; the workers' own free counts lag and include cache."""
        return [dataclasses.replace(v, free_blocks=v.num_blocks - self._committed.get(v.worker_id, 0))
                for v in self._views(role)]

    def _views(self, role: str) -> list[WorkerView]:
        return [w.view for wid, w in self._workers.items() if w.view.role == role and wid not in self._draining]

    # ---- introspection ----

    async def state(self) -> dict:
        return {
            "workers": {wid: dict(vars(w.view)) for wid, w in self._workers.items()},
            "worker_stats": {wid: dict(w.stats) for wid, w in self._workers.items()},
            "in_flight": len(self._requests),
            "committed_blocks": {wid: n for wid, n in self._committed.items() if n},
            "draining": sorted(self._draining),
            "incarnations": {wid: w.info["incarnation"] for wid, w in self._workers.items()},
            "counters": dict(self.counters),
        }

    async def check_integrity(self) -> dict:
        self._index.check_integrity()
        expected: dict[str, int] = {}
        for t in self._requests.values():
            expected[t.decode_id] = expected.get(t.decode_id, 0) + t.blocks
        actual = {wid: n for wid, n in self._committed.items() if n}
        if actual != {wid: n for wid, n in expected.items() if n}:
            raise RuntimeError(f"committed KV {actual} does not match the in-flight requests {expected}")
        for tracked in self._requests.values():
            unknown = tracked.workers - self._workers.keys()
            if unknown:
                raise RuntimeError(f"request {tracked.request_id} tracked on unknown workers {sorted(unknown)}")
        return await self.state()
