"""A worker: one engine in a role (prefill, decode or colocated), stepped by one thread. Ray reaches it
through the thin actor class of remote.py, which loads this module only in the worker's own process.

The scheduler's commands arrive on the process's command port (command_port.py, zmq), and Ray method
calls on any thread; both only put commands in an inbox: the engine thread alone touches the engine,
between steps. Per step it pushes one token message per client sink, hands finished
prefills to their decode workers, and ends expired leases. Every few tens of milliseconds it reports
stats, finished attempts and KV events to the global scheduler (over zmq, one report out at a time).

The roles (prefill, decode, colocated) are described with `WorkerSpec` (spec.py).

State: an attempt has one record, the engine's (actors/engine/requests.py), under its `AttemptId`, with
the worker's context of it (`Running`: what was asked, stage times) as its tag; it is running, reserved
or handed off there. The handoff table keeps the leases of reserved and handed-off attempts (deadlines,
writes in flight) and is the only way their blocks are freed. The inbox holds commands not yet taken.

Why the engine thread's commands (submit, adopt, abort, hand-off, expiry, failure, report) stay together:
each is a short method on the one thread that may touch the engine; splitting them would put that rule
in several places. What is apart: the inbox (commands in, submitted attempts not yet taken) is inbox.py,
the handoff steps (sending pages, adopting landed ones, ending leases) handoff_steps.py, grammars compiled
off this thread grammar_desk.py, reports are built by meter.py, the data-plane ends by kv_handoff.py, a
tensor-parallel group's other ranks live in tp_group.py, the chaos hooks are named in faults.py.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
import uuid
from concurrent.futures import Future

import torch

from actors.engine.engine import Engine
from actors.engine.model.parallel import SINGLE
from actors.engine.model.default_model import ensure_on_this_node
from actors.protocol.ids import AttemptId
from actors.protocol.messages import (
    FinishedAttempt, HandedOff, KvReservation, LiveRequest, StageTimes, TokenDelta, WorkerInfo,
    WorkerReport, WorkerRequest, WorkerStats,
)
from actors.protocol.request_status import RequestStatus
from actors.protocol.token_stream import TokenPublisher
from actors.protocol.tp_messages import PieceEvent
from actors.protocol.worker_commands import AbortAttempt, ReleaseAttempt, ReserveBlocks, SubmitAttempt, WorkerCommand
from actors.protocol.handoff_phase import HandoffPhase
from actors.tracing.tracer import start as start_tracing
from actors.worker.attempt_spans import AttemptSpans
from actors.worker.faults import Faults, HeldWrites, check_fault
from actors.worker.grammar_desk import GrammarDesk
from actors.worker.handoff_steps import HandoffSteps
from actors.worker.handoff_table import HandoffTable
from actors.worker.inbox import Inbox
from actors.worker.kv_handoff import HandoffEnds
from actors.worker.command_port import CommandPort
from actors.worker.mailbox import addressed, gathered
from actors.worker.meter import WorkerMeter
from actors.worker.pulse import Pulse
from actors.worker.running import Running
from actors.worker.scheduler_link import SchedulerLink
from actors.worker.spec import WorkerSpec
from actors.worker.step_log import StepLog, StepRecord
from actors.worker.tier_link import attach_node_tier
from actors.worker.tp_group import TPGroup

log = logging.getLogger("tandem.worker")
_CALL_TIMEOUT_S = 30.0
_EXIT_RECEIVER_DEAD = 70  # the process exit status when the KV receiving thread died: Ray restarts us
_EXIT_GROUP_LOST = 71  # ... when a rank of its tensor-parallel group ended


class Worker:
    def __init__(self, spec: WorkerSpec, scheduler=None, engine: Engine | None = None):
        """`engine`: a loaded engine with nothing in it, handed over by the worker this process was before a
        role flip (`hand_over`): no model load."""
        torch.set_num_threads(spec.torch_threads)
        self.spec = spec
        self.scheduler = scheduler
        self._tp = None
        if engine is not None:
            self._engine = engine
        else:
            model_dir = ensure_on_this_node(spec.engine.model, spec.engine.model_source)
            # A tensor-parallel worker: this actor is rank 0, the other ranks are actors of its own (tp_group.py).
            self._tp = TPGroup(spec) if spec.tensor_parallel_size > 1 else None
            self._engine = Engine(dataclasses.replace(spec.engine, model=model_dir),
                                  self._tp.comm if self._tp else SINGLE)
        # Set per role: a flip to prefill lifts it, one to decode sets it (`become` builds a new Worker).
        self._engine.batcher.max_prefill_tokens = spec.decode_prefill_tokens if spec.role == "decode" else None
        self._inbox = Inbox(spec.worker_id)
        self._publisher = TokenPublisher(keys=spec.curve_keys)
        self._handoffs = HandoffTable(self._engine, spec.lease_s)
        self._grammars = GrammarDesk(self._engine, self._inbox.put, spec.worker_id,
                                     lambda: self._faults.take_grammar_delay(), lambda s: self._faults.hold_grammar(s))
        self._held_writes = HeldWrites(self._handoffs.admit)  # the hold_kv_writes fault, around the table
        self._finished: list[FinishedAttempt] = []  # not yet reported
        self._handed_off: list[HandedOff] = []  # adopted, not yet reported: their prefill copies wait for it
        self._meter = WorkerMeter()
        self._step_log = StepLog()
        comm = self._tp.comm if self._tp else SINGLE
        self._ends = HandoffEnds(spec, self._engine.kv_caches, self._engine.kv_heads, comm, self._held_writes,
                                 self._on_piece)
        self._ends.join()  # with the group's other ranks, which do the same (tp_group.py)
        self._receiver = self._ends.receiver
        self._faults = Faults(self._receiver, self._held_writes)
        transport = "collective" if spec.transfer_backend == "collective" else (
            f"zmq-{spec.zmq_transport}" + ("+shm" if spec.kv_shm and spec.zmq_transport == "ipc" else ""))
        self._spans = AttemptSpans(start_tracing(spec.tracing, "tandem-worker"), spec.worker_id, spec.role, transport)
        self._steps = HandoffSteps(spec, self._engine, self._handoffs, self._ends, self._meter, self._faults,
                                   self._engine.runner.lead_task if self._tp else None, self._fail,
                                   lambda handed: self._handed_off.append(handed), self._spans)
        # A fresh id per process: the scheduler tells a restarted worker (new incarnation, its requests
        # lost) from one that re-announces itself (same incarnation, its requests still live).
        self._incarnation = uuid.uuid4().hex
        step_blocks = -(-spec.engine.max_num_batched_tokens // spec.engine.block_size)  # the most a step evicts
        self._tier = attach_node_tier(spec.kv_tier_namespace, spec.worker_id, f"{spec.worker_id}-{self._incarnation}",
                                      self._engine.kv_caches, self._tp is not None, step_blocks)
        self._engine.attach_tier(self._tier)
        self._stop = threading.Event()
        # The scheduler's commands and reservations arrive here (zmq), not as Ray calls.
        self._commands = CommandPort(self.deliver, self._reserve, spec.curve_keys, spec.host, spec.worker_id)
        self._link = None if scheduler is None else SchedulerLink(scheduler, spec.worker_id, self.info, self._live,
                                                                  spec.curve_keys)
        self._pulse = None
        if self._link is not None:
            # Registering itself (not from the launcher) is what lets a restarted worker rejoin.
            self._link.register()
            self._pulse = Pulse(spec.worker_id, self._incarnation, scheduler.pulse.remote)
        self._thread = threading.Thread(target=self._run, name=f"engine-{spec.worker_id}", daemon=True)
        self._thread.start()

    # ---- what the Ray actor (remote.py) calls, from any thread ----

    def info(self) -> WorkerInfo:
        return WorkerInfo(
            self.spec.worker_id, self.spec.role, self._ends.endpoints, self._engine.num_kv_blocks,
            self._engine.config.block_size, self._engine.model_bytes_per_block // self._engine.config.block_size,
            self._incarnation, self._commands.endpoint,
        )

    def tensor_parallel_ranks(self) -> list:
        """The actors of ranks 1.. of this worker's tensor-parallel group ([] for a one-rank worker)."""
        return list(self._tp.ranks) if self._tp else []

    def step_log(self, since: int = 0) -> tuple[int, list[StepRecord]]:
        """Its recent steps, as `StepRecord`s: (steps ever logged, the kept ones after the first `since`)."""
        return self._step_log.records(since)

    def kv_bytes(self) -> tuple[int, int]:
        """KV page bytes rank 0 has sent and received: its own share of the handoffs."""
        return self._ends.bytes_moved()

    def inject_fault(self, fault: str | None, delay_s: float = 1.0) -> None:
        """A chaos hook of faults.py; None clears every fault."""
        check_fault(fault)
        self._inbox.put(self._do_fault, (fault, delay_s))

    def deliver(self, commands: tuple[WorkerCommand, ...]) -> None:
        """The scheduler's fire-and-forget commands of one tick: each goes to `handle`."""
        for command in commands:
            if addressed(self.spec.worker_id, command):
                self.handle(command)

    def handle(self, command: WorkerCommand) -> None:
        """The one entry of every command (any thread): it only queues the engine thread's part."""
        match command:
            case SubmitAttempt(request=request):
                if self._faults.take_dropped_submit():
                    return  # chaos: this attempt never arrives, as if its delivery were lost
                # Prompts waiting in the inbox behind a long step are queued prefill work too: without them
                # the scheduler's TTFT prediction misses exactly the backlog that overload builds.
                self._inbox.arrived(request.attempt, len(request.request.prompt_token_ids), request.request.cache_salt)
                self._inbox.put(self._do_submit, (request, time.time()))
            case ReleaseAttempt(attempt=attempt):
                self._inbox.put(self._handoffs.release, attempt)
            case AbortAttempt(attempt=attempt):
                self._inbox.put(self._do_abort, attempt)
            case _:
                log.error("worker %s: dropped an unknown command %s", self.spec.worker_id, type(command).__name__)

    def _reserve(self, asks: tuple[ReserveBlocks, ...]) -> Future:
        """Queued for the engine thread at once (a later abort cannot overtake them); answered when decided."""
        if self._faults.slow_reserve_s:
            time.sleep(self._faults.slow_reserve_s)
        return gathered([self._inbox.ask(self._do_reserve, ask.request)
                         if addressed(self.spec.worker_id, ask) else None for ask in asks])

    def check_integrity(self) -> WorkerStats:
        return self._inbox.call(self._do_integrity, None, _CALL_TIMEOUT_S)

    def drain_estimate_s(self) -> float:
        """How long a drain could take now: its longest possible answer at the measured step time, after
        the prompts queued here, plus how long its oldest reservation has waited for KV (a placed request
        still to come: the wait so far stands for the wait to come, long when the prefill pool is behind).
        A role flip waits for the drain; a cold start may be quicker."""
        return self._inbox.call(self._do_drain_estimate, None, _CALL_TIMEOUT_S)

    def watch(self, worker_id: str | None = None) -> None:
        """Returns only at shutdown. The scheduler keeps one call pending, in a thread group of its
        own: it fails the moment this process dies, long before the heartbeat timeout. (`worker_id`:
        which worker of the process; a process hosts one real worker.)"""
        self._stop.wait()

    def incarnation(self, worker_id: str | None = None) -> str:
        """Which process answers: lets the scheduler tell a dropped watch call from a dead worker."""
        return self._incarnation

    def hand_over(self) -> Engine:
        """A role flip: stop serving and give up the engine, weights loaded and empty, its prefix cache
        dropped, for the worker this process becomes. Refused (ValueError, and it goes on serving) while it
        holds a request or a lease, or for a tensor-parallel worker, whose ranks are built for one role."""
        if self._tp is not None:
            raise ValueError(f"worker {self.spec.worker_id} is tensor-parallel: its role cannot change")
        self._inbox.call(self._check_empty, None, _CALL_TIMEOUT_S)
        self.shutdown()
        if self._thread.is_alive():
            raise RuntimeError(f"worker {self.spec.worker_id}: the engine thread did not stop")
        self._check_empty(None)  # a command that slipped in before the stop is here now, not lost unseen
        if not self._engine.reset_prefix_cache():
            raise RuntimeError(f"worker {self.spec.worker_id}: its prefix cache could not be dropped")
        return self._engine

    def _check_empty(self, _) -> None:
        held = len(self._engine.tags()) + len(self._finished) + len(self._handed_off) + self._grammars.waiting + sum(
            self._handoffs.count(kind) for kind in (HandoffPhase.RESERVED, HandoffPhase.HELD))
        if held or self._inbox.prompt_tokens:
            raise ValueError(f"worker {self.spec.worker_id} still serves {held} requests: drain it first")

    def shutdown(self) -> None:
        self._stop.set()
        self._inbox.put(lambda _: None, None)  # wakes the engine thread waiting for a command
        if self._pulse is not None:
            self._pulse.stop()
        self._thread.join(timeout=10)
        if self._tp is not None and not self._thread.is_alive():
            self._tp.stop(self._engine.runner)
        if self._tier is not None and not self._thread.is_alive():
            self._engine.attach_tier(None)
            self._tier.close()
        self._commands.close()
        self._grammars.close()
        self._ends.close()
        self._publisher.close()
        if self._link is not None and not self._thread.is_alive():  # (its socket is the engine thread's)
            self._link.close()

    # ---- the engine thread ----

    def _run(self) -> None:
        last_report = 0.0
        while not self._stop.is_set():
            waiting = not self._engine.has_work()
            if waiting:
                self._step_log.idle(time.perf_counter())
            self._inbox.drain(block_s=self.spec.heartbeat_s if waiting else None)
            self._steps.expire()
            if self._engine.has_work():
                start = time.perf_counter()
                self._step_log.started(start)
                time.sleep(self._faults.take_step_delay())  # chaos: a step longer than any timeout
                try:
                    outputs = self._engine.step()
                except Exception:  # a bug must cost the requests in flight, never the worker
                    log.exception("worker %s: engine step failed; failing its requests", self.spec.worker_id)
                    if self._tp is not None:  # the ranks may be anywhere in that step: the group starts over
                        self._exit("a step of the tensor-parallel group failed", _EXIT_GROUP_LOST, retryable=True)
                    self._fail_everything("internal error in the engine step")
                    continue
                engine_s = time.perf_counter() - start
                self._meter.step(engine_s, self._engine.last_step_tokens)
                self._step_log.ran(self._engine.last_step_shape, start, engine_s)
                self._publish(outputs)
            now = time.monotonic()
            if self._finished or self._handed_off or now - last_report >= self.spec.heartbeat_s:
                self._exit_if_broken()
                if self._tp is not None:
                    self._tp.between_steps(self._engine.runner)
                self._report()
                last_report = now

    def _exit_if_broken(self) -> None:
        """A decode worker whose KV receiving thread is gone can never adopt a handoff again, and a
        tensor-parallel group with a rank gone cannot step again, yet either would go on heartbeating: the
        process ends instead, and Ray starts a fresh one (for a group: rank 0, which starts new ranks)."""
        if self._stop.is_set():
            return
        if self._receiver is not None and not self._receiver.alive:
            self._exit("the decode worker's KV receiver died", _EXIT_RECEIVER_DEAD, retryable=False)
        if self._tp is not None and self._tp.lost:
            self._exit(f"its tensor-parallel group broke ({self._tp.lost})", _EXIT_GROUP_LOST, retryable=True)

    def _exit(self, why: str, status: int, retryable: bool) -> None:
        log.error("worker %s: %s; failing its requests and exiting", self.spec.worker_id, why)
        self._fail_everything(why, retryable)
        self._report()
        self._publisher.close(linger_s=1.0)  # the failure deltas still leave
        os._exit(status)

    def _do_submit(self, request: WorkerRequest, received_at: float) -> None:
        req = request.request
        if self._grammars.hold(request.attempt, req.params, lambda: self._do_submit(request, received_at),
                               lambda why: self._refuse(request, why)):
            return  # back here once its grammar has compiled off this thread (grammar_desk.py)
        self._inbox.taken(request.attempt)
        try:
            self._engine.add_request(request.attempt, list(req.prompt_token_ids), req.params, req.cache_salt,
                                     hand_off=request.dest is not None, output_prefix=req.output_prefix,
                                     tag=Running(request, StageTimes(received=received_at)))  # inbox wait included
        except Exception as exc:  # whatever went wrong, the request ends with an error, never hangs
            self._fail(request, str(exc) if isinstance(exc, ValueError) else f"{type(exc).__name__}: {exc}")

    def _refuse(self, request: WorkerRequest, why: str) -> None:
        self._inbox.taken(request.attempt)
        self._fail(request, why)

    def _do_reserve(self, request: WorkerRequest) -> KvReservation | None:
        self._grammars.warm(request.request.params)  # compiled by the time the pages land
        return self._handoffs.reserve(request.attempt, len(request.request.prompt_token_ids),
                                      Running(request, StageTimes()))

    def _do_abort(self, attempt: AttemptId) -> None:
        if self._grammars.drop(attempt):  # its grammar was compiling: it never reached the engine
            self._inbox.taken(attempt)
            return
        # A leased attempt ends through the handoff table only: a reservation whose pages are being
        # written keeps its blocks until the write is over.
        if self._handoffs.release(attempt) is None:
            run = self._engine.tag(attempt)
            if self._engine.abort(attempt):
                self._spans.ended(run, RequestStatus.CANCELLED)

    def _do_fault(self, fault: str | None, delay_s: float) -> None:
        self._faults.inject(fault, delay_s)

    def _do_drain_estimate(self, _) -> float:
        step_s, per_token_s = self._meter.step_s or 0.0, self._meter.prefill_s_per_token or 0.0
        return (self._engine.longest_remaining_tokens() * step_s
                + self._engine.load().queued_prefill_tokens * per_token_s
                + self._handoffs.oldest_reservation_s(time.monotonic()))

    def _do_integrity(self, _) -> WorkerStats:
        self._engine.check_integrity()
        self._handoffs.check_integrity()
        return self._stats()

    # ---- per step ----

    def _publish(self, outputs) -> None:
        by_sink: dict[str, list[TokenDelta]] = {}
        done: dict[AttemptId, RequestStatus] = {}
        for out in outputs:
            run: Running = out.tag
            by_sink.setdefault(run.request.request.sink, []).append(run.delta(out, self._meter))
            if out.status == RequestStatus.TRANSFERRING:
                self._steps.send(run, out)
            elif out.finished:
                done[run.attempt] = out.status
                self._spans.ended(run, out.status, out.num_output_tokens, out.num_cached_tokens)
        for sink, deltas in by_sink.items():
            self._publisher.publish(sink, deltas)
        for attempt, status in done.items():
            if not self._engine.is_live(attempt):  # every sample of it ended
                self._finished.append(FinishedAttempt(attempt, status))

    def _fail_everything(self, message: str, retryable: bool = False) -> None:
        for lease in self._handoffs.release_all():
            if lease.kind is HandoffPhase.RESERVED:
                self._fail(lease.context.request, message, retryable)
        for phase, run in self._engine.tags():
            if phase is HandoffPhase.RUNNING:
                self._engine.abort(run.attempt)
                self._spans.ended(run, RequestStatus.FAILED, error=message)
                self._fail(run.request, message, retryable)

    def _fail(self, request: WorkerRequest, message: str, retryable: bool = False) -> None:
        self._publisher.publish(request.request.sink, [TokenDelta.failure(request, message, retryable)])
        self._finished.append(FinishedAttempt(request.attempt, RequestStatus.FAILED))

    def _on_piece(self, event: PieceEvent) -> None:  # on a KV receiver's thread, or the piece desk's
        self._inbox.put(self._steps.landed, (event, time.time()))  # stamped here: not behind a step

    # ---- reporting ----

    def _stats(self) -> WorkerStats:
        running = sum(phase is HandoffPhase.RUNNING for phase, _ in self._engine.tags())
        return self._meter.stats(self.spec, self._engine.load(), self._handoffs, running,
                                 self._inbox.prompt_tokens_by_tenant(), self._publisher.dropped, self._receiver,
                                 self._commands.drops.snapshot())

    def _report(self) -> None:
        if self._link is not None and not self._link.ready():
            return  # the last report is not answered yet: what this one would carry waits for the next
        finished, self._finished = self._finished, []
        handed_off, self._handed_off = self._handed_off, []
        events, meter = tuple(self._engine.take_kv_events()), self._meter
        report = WorkerReport(self.spec.worker_id, self._stats(), tuple(finished), events,
                              meter.take_first_token_waits(), self._inbox.take_received(), meter.take_transfers(),
                              tuple(handed_off))
        if self._link is not None:
            self._link.report(report)
            self._pulse.reported()

    def _live(self) -> list[LiveRequest]:
        """Every request this worker holds state for, so a restarted scheduler can rebuild its view."""
        # (a reservation aborted during a page write keeps its blocks until the write ends: not live)
        return [LiveRequest(phase, run.request) for phase, run in self._engine.tags()
                if phase is HandoffPhase.RUNNING or self._handoffs.get(run.attempt) is not None]
