"""The scheduler's view of its workers: who is registered, who died, who is draining.

A mixin of the scheduler actor (one event loop, so no locks): workers register themselves, again
after a restart (a new incarnation: its requests are gone) or after this scheduler restarted or gave
up on them (the same incarnation: its live requests are adopted, or aborted if they were re-routed
meanwhile). A worker is routed around as soon as Ray reports its process dead, or when its reports
stop for the heartbeat timeout; its requests are re-routed if nothing reached the client, else
failed as retryable so the client migrates them.
"""

from __future__ import annotations

import asyncio
import logging
import time

import ray

from cluster.control.routing import PrefillPlan, WorkerView
from cluster.control.scheduler_state import Tracked, WorkerEntry, attempt_of

log = logging.getLogger("tandem.scheduler")


class Membership:
    async def register(self, info: dict, handle, live: list[dict] = ()) -> bool:
        """A worker joins: new, restarted by Ray (a new incarnation: its old requests are gone), or
        re-announcing itself (same incarnation) because this scheduler restarted or its watchdog gave
        up on it. `live` is every request the worker still holds state for."""
        wid = info["worker_id"]
        known = self._workers.get(wid)
        if known is not None and known.info["incarnation"] != info["incarnation"]:
            self._forget_worker(wid, "it restarted")
            known = None
        if known is None:
            view = WorkerView(wid, info["role"], info["num_blocks"], info["num_blocks"])
            self._workers[wid] = WorkerEntry(handle, info, view)
            asyncio.get_running_loop().create_task(self._watch_process(wid, info["incarnation"], handle))
            log.info("registered %s worker %s (%d live requests)", info["role"], wid, len(live))
        if self._lost.pop(wid, None) == info["incarnation"]:
            # Declared dead during a stall: its requests were re-routed or failed since; stop its copies.
            for entry in live:
                handle.abort.remote(entry["request"]["request_id"])
        else:
            for entry in live:
                self._adopt_live(wid, entry["phase"], entry["request"])
        if self._watchdog is None:
            self._watchdog = asyncio.get_running_loop().create_task(self._watch())
        return True

    def _adopt_live(self, wid: str, phase: str, request: dict) -> None:
        """Rebuild the tracking of a request a worker still serves (after this scheduler restarted).
        Idempotent: a worker may announce the same request more than once."""
        wire_id = request["request_id"]
        request_id = attempt_of(wire_id)
        role = self._workers[wid].view.role
        if phase == "held":
            # Its pages were sent in full; the decode side announces the request itself. Tracking the
            # hold would outlive a request that finished while no scheduler could hear of it.
            self._workers[wid].handle.release.remote(wire_id)
            return
        tracked = self._requests.get(request_id)
        if tracked is not None and tracked.wire_id != wire_id:
            self._workers[wid].handle.abort.remote(wire_id)  # an attempt that was superseded
            return
        if tracked is None:
            decode_id = request["dest"]["decode_worker"] if role == "prefill" else wid
            tracked = Tracked(request_id, wire_id, set(), None, decode_id, self._blocks_needed(request),
                               request={**request, "request_id": request_id})
            self._commit(tracked)
        tracked.workers.add(wid)
        if role == "prefill":
            tracked.prefill = PrefillPlan(wid, False, 0, 0.0)
        elif phase == "running" and tracked.prefill is not None and tracked.prefill.worker_id != wid:
            tracked.handed_off = True
        if tracked.handed_off and tracked.prefill is not None and tracked.prefill.worker_id in tracked.workers:
            # The decode side adopted the pages while no scheduler could pass on its ack.
            self._release_prefill(tracked)

    async def _watch(self) -> None:
        """Declare workers dead when their reports stop; their requests are re-routed or failed."""
        while True:
            await asyncio.sleep(min(0.5, self.s.heartbeat_timeout_s / 4))
            now = time.monotonic()
            for wid, worker in list(self._workers.items()):
                if now - worker.last_seen > self.s.heartbeat_timeout_s:
                    log.warning("worker %s sent no report for %.1fs: routing around it", wid, now - worker.last_seen)
                    self._forget_worker(wid, "it stopped responding")
                    self._lost[wid] = worker.info["incarnation"]
                    del self._workers[wid]
                    self.counters["workers_lost"] += 1

    async def _watch_process(self, wid: str, incarnation: str, handle) -> None:
        """Route around a worker as soon as Ray reports its process dead (the heartbeat timeout is
        for workers that hang while alive)."""
        while True:
            try:
                await handle.watch.remote()
                return  # a clean shutdown
            except ray.exceptions.RayError:
                pass
            try:  # a call can fail while the process lives (a busy host): ask which process answers
                alive = await asyncio.wait_for(handle.incarnation.remote(), 2.0) == incarnation
            except (ray.exceptions.RayError, asyncio.TimeoutError):
                alive = False
            if not alive:
                break
        worker = self._workers.get(wid)
        if worker is None or worker.info["incarnation"] != incarnation:
            return  # already forgotten, or already replaced by its restarted self
        log.warning("worker %s died: routing around it", wid)
        self._forget_worker(wid, "its process died")
        del self._workers[wid]
        self.counters["workers_lost"] += 1

    def _forget_worker(self, wid: str, why: str) -> None:
        """Every request that touches a lost worker: re-route it if nothing was emitted yet, else fail it."""
        self._index.forget(wid)
        for tracked in [t for t in self._requests.values() if wid in t.workers]:
            prefill_only = tracked.prefill is not None and tracked.prefill.worker_id == wid and not tracked.handed_off
            self._reclaim(tracked.request_id, tracked.wire_id, failed=not prefill_only, skip=wid)
            if prefill_only:
                # Nothing has reached the client from a prefill that never handed off: run it again.
                self.counters["rerouted"] += 1
                asyncio.get_running_loop().create_task(self._resubmit(tracked.request))
            else:
                self._tell_client(tracked.request, f"worker {wid} was lost ({why}) while serving the request",
                                  retryable=True, wire_id=tracked.wire_id)

    async def drain(self, worker_id: str) -> None:
        """Route nothing new to the worker; what it serves now finishes there."""
        if worker_id not in self._workers:
            raise ValueError(f"unknown worker {worker_id!r}")
        self._draining.add(worker_id)

    async def remove(self, worker_id: str) -> bool:
        """Forget a drained worker; False (and nothing changes) while a request still involves it."""
        if any(worker_id in t.workers or t.decode_id == worker_id for t in self._requests.values()):
            return False
        self._workers.pop(worker_id, None)
        self._index.forget(worker_id)
        self._draining.discard(worker_id)
        self._committed.pop(worker_id, None)
        return True
