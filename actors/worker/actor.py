"""The Ray worker actor: one engine in a role (prefill, decode or colocated), stepped by one thread.

Ray method calls (any thread) only put commands in an inbox; the engine thread alone touches the
engine, between steps. Per step it pushes one token message per client sink, hands finished
prefills to their decode workers, and expires leases. Every few tens of milliseconds it reports
stats, finished requests and KV events to the global scheduler (fire-and-forget).

Roles:
- prefill: computes the prompt, samples the first token, pushes the KV pages to the reserved blocks
  of a decode worker, and holds its own blocks until the scheduler releases them (or the lease ends).
- decode: reserves blocks for incoming KV, adopts the request when the pages have landed, decodes.
  It also runs whole requests (a local prefill) when the scheduler's cost model says so.
- colocated: whole requests, prefill and decode in one engine.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import uuid
from concurrent.futures import Future

import ray
import torch

from actors.engine.engine import Engine
from actors.protocol.request_status import RequestStatus
from actors.protocol.token_stream import TokenDelta, TokenPublisher
from actors.protocol.worker_request import (
    WorkerRequest,
    WorkerSpec,
    request_from_wire,
    request_stub,
    request_to_wire,
)
from actors.worker.kv_handoff import HandoffReceiver, HandoffSender
from actors.worker.meter import WorkerMeter
from actors.worker.scheduler_link import SchedulerLink
from kv_transfer.collective_transport import init_collective

log = logging.getLogger("tandem.worker")
_CALL_TIMEOUT_S = 30.0


class Worker:
    def __init__(self, spec: WorkerSpec, scheduler=None):
        torch.set_num_threads(spec.torch_threads)
        self.spec = spec
        self.scheduler = scheduler
        self.engine = Engine(spec.engine)
        self._inbox: queue.Queue = queue.Queue()
        self._inbox_lock = threading.Lock()
        self._inbox_prompt_tokens = 0
        self._publisher = TokenPublisher()
        self._requests: dict[str, WorkerRequest] = {}
        self._reserved: dict[str, WorkerRequest] = {}  # decode: blocks reserved, KV not yet adopted
        self._held: dict[str, WorkerRequest] = {}  # prefill: KV sent, blocks held until released
        self._finished: list[tuple[str, int]] = []  # (request id, final status) not yet reported
        self._meter = WorkerMeter()
        caches = self.engine.runner.kv_caches
        group = None
        if spec.transfer_backend == "collective":
            # Every worker joins at construction; Ray builds them concurrently, so the rendezvous completes.
            group = init_collective(spec.collective_init, spec.rank, spec.world_size, device=spec.engine.device)
        self._sender = HandoffSender(caches, group) if spec.role == "prefill" else None
        self._receiver = None
        if spec.role == "decode":
            self._receiver = HandoffReceiver(caches, self._accept_pages, self._on_pages,
                                             spec.zmq_transport, spec.host, group)
        # A fresh id per process: the scheduler tells a restarted worker (new incarnation, its requests
        # lost) from one that re-announces itself (same incarnation, its requests still live).
        self._incarnation = uuid.uuid4().hex
        self._faults: set[str] = set()
        self._stop = threading.Event()
        self._link = None if scheduler is None else SchedulerLink(scheduler, spec.worker_id, self.info, self._live)
        if self._link is not None:
            # Registering itself (not from the launcher) is what lets a restarted worker rejoin.
            self._link.register()
        self._thread = threading.Thread(target=self._run, name=f"engine-{spec.worker_id}", daemon=True)
        self._thread.start()

    # ---- Ray methods: called from any thread ----

    def info(self) -> dict:
        return {
            "worker_id": self.spec.worker_id,
            "role": self.spec.role,
            "kv_endpoint": self._receiver.endpoint if self._receiver else None,
            "num_blocks": self.engine.runner.num_kv_blocks,
            "block_size": self.engine.config.block_size,
            "kv_bytes_per_token": self.engine.runner.bytes_per_block // self.engine.config.block_size,
            "incarnation": self._incarnation,
        }

    def inject_fault(self, fault: str | None) -> None:
        """Chaos hook: `drop_kv_sends` (prefill: pages are lost on the wire), `ignore_kv_arrivals`
        (decode: pages land but are never adopted or acked); None clears every fault."""
        if fault not in (None, "drop_kv_sends", "ignore_kv_arrivals"):
            raise ValueError(f"unknown fault {fault!r}")
        self._inbox.put(("fault", fault))

    def submit(self, request: dict) -> None:
        with self._inbox_lock:
            # Prompts waiting in the inbox behind a long step are queued prefill work too: without them
            # the scheduler's TTFT prediction misses exactly the backlog that overload builds.
            self._inbox_prompt_tokens += len(request.get("prompt_token_ids", ()))
        self._inbox.put(("submit", {**request, "received_at": time.time()}))

    def reserve(self, request: dict) -> list[int] | None:
        return self._call("reserve", request)

    def release(self, request_id: str) -> None:
        self._inbox.put(("release", request_id))

    def abort(self, request_id: str) -> None:
        self._inbox.put(("abort", request_id))

    def check_integrity(self) -> dict:
        return self._call("integrity", None)

    @ray.method(concurrency_group="watch")
    def watch(self) -> None:
        """Returns only at shutdown. The scheduler keeps one call pending, in a thread group of its
        own: it fails the moment this process dies, long before the heartbeat timeout."""
        self._stop.wait()

    @ray.method(concurrency_group="watch")
    def incarnation(self) -> str:
        """Which process answers: lets the scheduler tell a dropped watch call from a dead worker."""
        return self._incarnation

    def shutdown(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        if self._receiver:
            self._receiver.close()
        self._publisher.close()

    def _call(self, kind: str, arg):
        future: Future = Future()
        self._inbox.put((kind, arg, future))
        return future.result(timeout=_CALL_TIMEOUT_S)

    # ---- the engine thread ----

    def _run(self) -> None:
        last_report = 0.0
        while not self._stop.is_set():
            self._drain_inbox(block=not self.engine.has_work())
            self._expire_leases()
            if self.engine.has_work():
                start = time.perf_counter()
                try:
                    outputs = self.engine.step()
                except Exception:  # a bug must cost the requests in flight, never the worker
                    log.exception("worker %s: engine step failed; failing its requests", self.spec.worker_id)
                    self._fail_everything("internal error in the engine step")
                    continue
                self._meter.step(time.perf_counter() - start, self.engine.last_step_tokens)
                self._publish(outputs)
            now = time.monotonic()
            if self._finished or now - last_report >= self.spec.heartbeat_s:
                self._report()
                last_report = now

    def _drain_inbox(self, block: bool) -> None:
        try:
            item = self._inbox.get(timeout=self.spec.heartbeat_s) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            self._handle(item)
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _handle(self, item: tuple) -> None:
        kind, arg, *rest = item
        future: Future | None = rest[0] if rest else None
        try:
            result = getattr(self, f"_do_{kind}")(arg)
        except Exception as exc:  # a bad request must not kill the engine thread
            if future is None:
                log.exception("worker %s: %s failed", self.spec.worker_id, kind)
                return
            future.set_exception(exc)
            return
        if future is not None:
            future.set_result(result)

    def _do_submit(self, request: dict) -> None:
        with self._inbox_lock:
            self._inbox_prompt_tokens -= len(request.get("prompt_token_ids", ()))
        try:
            req = request_from_wire(request)
        except (TypeError, ValueError) as exc:
            self._fail(request_stub(request), f"bad request: {exc}")
            return
        try:
            self.engine.add_request(req.request_id, req.prompt_token_ids, req.params, req.cache_salt,
                                    hand_off=req.dest is not None, output_prefix=req.output_prefix)
        except Exception as exc:  # whatever went wrong, the request ends with an error, never hangs
            self._fail(req, f"{type(exc).__name__}: {exc}" if not isinstance(exc, ValueError) else str(exc))
            return
        req.timings["received"] = request.get("received_at", time.time())  # inbox wait included
        self._requests[req.request_id] = req

    def _do_reserve(self, request: dict) -> list[int] | None:
        req = request_from_wire(request)
        blocks = self.engine.reserve(req.request_id, len(req.prompt_token_ids))
        if blocks is not None:
            req.deadline = time.monotonic() + self.spec.lease_s
            self._reserved[req.request_id] = req
        return blocks

    def _do_adopt(self, header) -> None:
        if "ignore_kv_arrivals" in self._faults:
            return  # the reservation stays until its lease ends, and the sender never gets an ack
        req = self._reserved.pop(header.transfer_id, None)
        if req is None:
            return  # aborted meanwhile
        self.engine.adopt(req.request_id, req.prompt_token_ids, header.extra["first_token"], req.params,
                          req.cache_salt, header.extra.get("num_cached_tokens", 0))
        req.timings.update(header.extra.get("timings", {}), adopted=time.time())
        self._requests[req.request_id] = req
        self._meter.adopted += 1
        if self.scheduler is not None:
            self.scheduler.handoff_done.remote(req.request_id, header.extra.get("prefill_worker"))

    def _do_transfer_failed(self, arg: tuple[str, str]) -> None:
        request_id, reason = arg
        req = self._reserved.pop(request_id, None)
        if req is not None:
            self.engine.release_reservation(request_id)
            self._fail(req, f"KV transfer refused: {reason}")

    def _do_release(self, request_id: str) -> None:
        if self._held.pop(request_id, None) is not None:
            self.engine.release_handoff(request_id)

    def _do_abort(self, request_id: str) -> None:
        self.engine.abort(request_id)
        for table in (self._requests, self._reserved, self._held):
            table.pop(request_id, None)

    def _do_fault(self, fault: str | None) -> None:
        if fault is None:
            self._faults.clear()
        else:
            self._faults.add(fault)

    def _do_integrity(self, _) -> dict:
        self.engine.check_integrity()
        return self._stats()

    # ---- per step ----

    def _publish(self, outputs) -> None:
        by_sink: dict[str, list[TokenDelta]] = {}
        done: set[str] = set()
        for out in outputs:
            req = self._requests.get(out.request_id)
            if req is None:
                continue
            logprobs = None
            if out.new_logprobs is not None:
                logprobs = [[lp.token_id, lp.logprob, [list(t) for t in lp.top]] for lp in out.new_logprobs]
            offset = out.num_output_tokens - len(out.new_token_ids)
            timings = None
            if offset == 0 or out.finished:  # stamps travel on the first and the last delta only
                if offset == 0:
                    req.timings.update(scheduled=out.first_scheduled_time, first_token=time.time())
                    if "received" in req.timings:  # what the scheduler's TTFT prediction is checked against
                        self._meter.first_token_waits.append(
                            (req.request_id, req.timings["first_token"] - req.timings["received"]))
                if out.finished:
                    req.timings["finished"] = time.time()
                timings = dict(req.timings)
            by_sink.setdefault(req.sink, []).append(TokenDelta(
                out.request_id, out.index, offset, out.new_token_ids,
                int(out.status), out.num_prompt_tokens, out.num_cached_tokens, None, logprobs, timings,
            ))
            if out.status == RequestStatus.TRANSFERRING:
                self._hand_off(req, out)
            elif out.finished:
                done.add(out.request_id)
        for sink, deltas in by_sink.items():
            self._publisher.publish(sink, deltas)
        for request_id in done:
            if not self.engine.is_live(request_id):
                self._requests.pop(request_id, None)
                self._finished.append((request_id, int(RequestStatus.FINISHED_STOPPED)))

    def _hand_off(self, req: WorkerRequest, out) -> None:
        extra = {"first_token": out.new_token_ids[0], "num_cached_tokens": out.num_cached_tokens,
                 "timings": req.timings, "prefill_worker": self.spec.worker_id}
        try:
            if "drop_kv_sends" not in self._faults:
                self._sender.send(req.dest["endpoint"], req.request_id, req.dest["lease_id"],
                                  self.engine.handoff_blocks(req.request_id), req.dest["block_ids"], extra,
                                  timeout_s=min(self.spec.lease_s, 10.0))
        except Exception as exc:
            self._meter.transfers_failed += 1
            self.engine.release_handoff(req.request_id)
            self._requests.pop(req.request_id, None)
            # The decode side is gone or unreachable: the client may continue the request elsewhere.
            self._fail(req, f"KV transfer to the decode worker failed: {exc}", retryable=True)
            return
        self._meter.transfers_sent += 1
        self._meter.kv_bytes_sent += len(req.dest["block_ids"]) * self.engine.runner.bytes_per_block
        self._requests.pop(req.request_id, None)
        req.deadline = time.monotonic() + self.spec.lease_s
        self._held[req.request_id] = req

    def _expire_leases(self) -> None:
        now = time.monotonic()
        for request_id, req in list(self._held.items()):
            if req.deadline < now:
                log.warning("worker %s: no release for %s within the lease; freeing its blocks", self.spec.worker_id, request_id)
                del self._held[request_id]
                self.engine.release_handoff(request_id)
                self._meter.lease_expired(now - req.deadline)
        for request_id, req in list(self._reserved.items()):
            if req.deadline < now and self._receiver.begin_expiry(request_id):
                del self._reserved[request_id]
                self.engine.release_reservation(request_id)
                self._meter.lease_expired(now - req.deadline)
                # The first token may have reached the client already: it can continue the request elsewhere.
                self._fail(req, f"KV for {request_id} did not arrive within the {self.spec.lease_s}s lease",
                           retryable=True)

    def _fail_everything(self, message: str) -> None:
        for table in (self._requests, self._reserved, self._held):
            for request_id, req in list(table.items()):
                self.engine.abort(request_id)
                del table[request_id]
                if table is not self._held:
                    self._fail(req, message)

    def _fail(self, req: WorkerRequest, message: str, retryable: bool = False) -> None:
        delta = TokenDelta(req.request_id, 0, 0, [], int(RequestStatus.FAILED), len(req.prompt_token_ids), 0, message,
                           retryable=retryable)
        self._publisher.publish(req.sink, [delta])
        self._finished.append((req.request_id, int(RequestStatus.FAILED)))

    # ---- receiver callbacks (the receiver's thread) ----

    def _accept_pages(self, header) -> bool:
        """Pages may be written only into a live reservation (never into freed, reused blocks)."""
        req = self._reserved.get(header.transfer_id)
        return req is not None and list(header.dest_block_ids) == self.engine.kv.block_table((req.request_id, 0))

    def _on_pages(self, header, error: Exception | None) -> None:
        if error is None:
            self._inbox.put(("adopt", header))
        elif header is not None:
            self._inbox.put(("transfer_failed", (header.transfer_id, str(error))))

    # ---- reporting ----

    def _stats(self) -> dict:
        pool = self.engine.kv.pool
        return {
            "worker_id": self.spec.worker_id,
            "role": self.spec.role,
            "free_blocks": pool.num_free_blocks,
            "num_blocks": pool.num_blocks,
            "used_blocks": pool.num_used_blocks,
            "running": len(self.engine.batcher.running),
            "waiting": len(self.engine.batcher.waiting),
            "queued_prefill_tokens": self.engine.batcher.queued_prefill_tokens() + self._inbox_prompt_tokens,
            "preemptions": self.engine.batcher.num_preemptions,
            "reserved": len(self._reserved),
            "held": len(self._held),
            "live_requests": len(self._requests),
            "tokens_dropped": self._publisher.dropped,
            **self._meter.stats(),
        }

    def _report(self) -> None:
        finished, self._finished = self._finished, []
        events = self.engine.take_kv_events()
        if self._link is None:
            return
        stats = self._stats()
        stats["first_token_waits"] = self._meter.take_first_token_waits()
        self._link.report(stats, finished, events)

    def _live(self) -> list[dict]:
        """Every request this worker holds state for, so a restarted scheduler can rebuild its view."""
        phases = (("running", self._requests), ("reserved", self._reserved), ("held", self._held))
        return [{"phase": phase, "request": request_to_wire(req)} for phase, table in phases for req in table.values()]


def worker_actor():
    """The Worker as a Ray actor class: its "watch" method runs in a thread group of its own."""
    return ray.remote(concurrency_groups={"watch": 2})(Worker)  # the pending watch, and probes
