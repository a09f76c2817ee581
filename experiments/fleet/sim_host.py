"""One Ray actor (one process) hosting many simulated workers, each with its own identity.

Seen from the scheduler each is a worker like any other: it registers itself with this actor's handle,
reports (the host sends all its workers' reports in one `Reports` frame per heartbeat and scheduler
shard, over the real worker's `ReportLink`), is watched (`watch(worker_id)` fails when it dies), and
takes the batched commands of worker_commands.py on the real worker's `CommandPort` (one per host). Handoff
notes travel host to host over zmq (PUSH to the decode worker's advertised endpoint, one PULL socket
per host), token deltas to the client's sink over zmq, as a real worker's do. `kill` ends chosen
workers as a crash would: they stop reporting and answering, and their watch fails.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import resource
import time
import uuid

import msgspec
import ray
import zmq

from actors.engine.kv.block_hash import PrefixHasher
from actors.protocol.codec import encode
from actors.protocol.messages import KvReservation
from actors.protocol.token_stream import TokenPublisher
from actors.worker.command_port import CommandPort
from actors.worker.report_link import ReportLink
from actors.protocol.worker_commands import ReleaseAttempt, ReserveBlocks, SubmitAttempt, WorkerCommand
from experiments.fleet.sim_worker import SimPages, SimSpec, SimWorker
from kv_transfer.drops import DropCounter

log = logging.getLogger("tandem.sim")


class WorkerGone(RuntimeError):
    """A simulated worker's process "died": what its pending watch call raises."""


class SimHost:
    def __init__(self, workers: list[tuple[str, str, int]], spec: SimSpec, schedulers: list, model_id: str,
                 heartbeat_s: float = 0.05, host: str = "127.0.0.1"):
        """`workers`: (worker id, role, the index in `schedulers` of the scheduler shard it joins)."""
        self._spec, self._schedulers, self._heartbeat_s = spec, schedulers, heartbeat_s
        self._shard = {wid: shard for wid, _, shard in workers}
        self._context = zmq.Context.instance()
        self._pull = self._context.socket(zmq.PULL)
        self._pull.setsockopt(zmq.LINGER, 0)
        self.endpoint = f"tcp://{host}:{self._pull.bind_to_random_port(f'tcp://{host}')}"
        self._pushes: dict[str, zmq.Socket] = {}
        self._pages = msgspec.msgpack.Decoder(SimPages)
        self.drops = DropCounter("sim_pages")
        self._publisher = TokenPublisher(self._context)
        hasher = PrefixHasher(spec.block_size, model_id)
        self._workers = {wid: SimWorker(wid, role, spec, self.endpoint, uuid.uuid4().hex, hasher)
                         for wid, role, _ in workers}
        self._gone: dict[str, asyncio.Event] = {}
        self._reports = [ReportLink(scheduler, None) for scheduler in schedulers]  # one per scheduler shard
        self._loop_task: asyncio.Task | None = None
        self._commands: CommandPort | None = None
        self._host = host
        self.steps = self.failed_steps = 0
        self.late_s = 0.0  # summed lateness of steps against the step clock: the host's own overload

    async def start(self) -> str:
        """Register every worker and start stepping; the host's page endpoint."""
        handle = ray.get_runtime_context().current_actor
        loop = asyncio.get_running_loop()
        self._commands = CommandPort(lambda commands: loop.call_soon_threadsafe(self.deliver_now, commands),
                                     lambda asks: _on_loop(loop, self.reserve_now, asks), None, self._host, "sim-host")
        for worker in self._workers.values():
            worker.command_endpoint = self._commands.endpoint
        await asyncio.gather(*(self._scheduler(w.worker_id).register.remote(w.info(), handle, w.live())
                               for w in self._workers.values()))
        self._loop_task = asyncio.get_running_loop().create_task(self._run())
        return self.endpoint

    # ---- the scheduler's calls ----

    def deliver_now(self, commands: tuple[WorkerCommand, ...]) -> None:
        """The scheduler's commands (on the host's loop): what its command port hands on."""
        now, wall = time.monotonic(), time.time()
        for command in commands:
            worker = self._alive(command.worker_id)
            if worker is None:
                continue
            if isinstance(command, SubmitAttempt):
                worker.submit(command.request, now, wall)
            elif isinstance(command, ReleaseAttempt):
                worker.release(command.attempt)
            else:
                worker.abort(command.attempt)

    def reserve_now(self, asks: tuple[ReserveBlocks, ...]) -> tuple[KvReservation | None, ...]:
        now = time.monotonic()
        return tuple(w.reserve(ask.request, now) if (w := self._alive(ask.worker_id)) else None for ask in asks)

    async def watch(self, worker_id: str) -> None:
        gone = self._gone.setdefault(worker_id, asyncio.Event())
        if self._alive(worker_id) is not None:
            await gone.wait()
        raise WorkerGone(f"simulated worker {worker_id} died")

    async def incarnation(self, worker_id: str) -> str | None:
        worker = self._alive(worker_id)
        return None if worker is None else worker.incarnation

    # ---- for the benchmark and tests ----

    async def kill(self, worker_ids: list[str]) -> None:
        for wid in worker_ids:
            self._workers[wid].alive = False
            self._gone.setdefault(wid, asyncio.Event()).set()

    async def check_integrity(self) -> dict:
        for worker in self._workers.values():
            if worker.alive:
                worker.check_integrity()
        return {"steps": self.steps, "failed_steps": self.failed_steps, "late_s": self.late_s,
                "dropped": self.drops.snapshot()}

    async def holding(self, request_ids: list[str]) -> dict[str, list[tuple[str, str, str]]]:
        """For diagnosis: which of its live workers hold these requests: (worker, phase, attempt)."""
        wanted, out = set(request_ids), {}
        for worker in self._workers.values():
            if worker.alive:
                for item in worker.live():
                    rid = item.request.attempt.request_id
                    if rid in wanted:
                        attempt = item.request.attempt.attempt
                        out.setdefault(rid, []).append((worker.worker_id, item.phase.value, attempt))
        return out

    def _scheduler(self, worker_id: str):
        return self._schedulers[self._shard[worker_id]]

    def _alive(self, worker_id: str) -> SimWorker | None:
        worker = self._workers.get(worker_id)
        return worker if worker is not None and worker.alive else None

    # ---- the step clock ----

    async def _run(self) -> None:
        next_step = next_report = time.monotonic()
        while True:
            try:
                self._step()
            except Exception:  # one bad step must not stop the host's workers for good
                self.failed_steps += 1
                log.exception("simulated host step failed")
            now = time.monotonic()
            if now >= next_report:
                self._report()
                next_report = now + self._heartbeat_s
            next_step += self._spec.step_s
            delay = next_step - time.monotonic()
            if delay < 0:
                self.late_s -= delay
                next_step = time.monotonic()
            await asyncio.sleep(max(delay, 0.0))

    def _step(self) -> None:
        now, wall = time.monotonic(), time.time()
        self._take_pages(wall)
        deltas: dict[str, list] = {}
        sends: list[tuple[str, SimPages]] = []
        for worker in self._workers.values():
            if worker.alive:
                worker.step(now, wall, deltas, sends)
        for sink, batch in deltas.items():
            self._publisher.publish(sink, batch)
        for endpoint, pages in sends:
            self._push(endpoint, encode(pages))
        self.steps += 1

    def _take_pages(self, wall: float) -> None:
        while True:
            try:
                payload = self._pull.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                pages = self._pages.decode(payload)
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                self.drops.drop("malformed", exc)
                continue
            worker = self._alive(pages.decode_worker)
            if worker is None:
                self.drops.drop("no_worker", pages.lease_id)
                continue
            worker.pages(pages, wall)

    def _push(self, endpoint: str, payload: bytes) -> None:
        sock = self._pushes.get(endpoint)
        if sock is None:
            sock = self._pushes[endpoint] = self._context.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(endpoint)
        try:
            sock.send(payload, zmq.NOBLOCK)
        except zmq.Again:
            self.drops.drop("full", endpoint)

    def _report(self) -> None:
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        by_shard: dict[int, list[SimWorker]] = {}
        for w in self._workers.values():
            if w.alive:
                by_shard.setdefault(self._shard[w.worker_id], []).append(w)
        handle = ray.get_runtime_context().current_actor
        for shard, alive in by_shard.items():  # one frame per scheduler shard
            link = self._reports[shard]
            # A worker the scheduler does not know (it restarted, or gave up on it) registers again.
            for wid in link.take_unknown():
                worker = self._alive(wid)
                if worker is not None:
                    self._scheduler(wid).register.remote(worker.info(), handle, worker.live())
            # One report out at a time, as a real worker's: the next carries what this one would have
            # (finishes stay queued).
            if link.ready():
                link.send(tuple(w.report(rss) for w in alive))


def _on_loop(loop: asyncio.AbstractEventLoop, fn, arg) -> concurrent.futures.Future:
    """`fn(arg)` run on `loop`, from another thread; its result as a future of that thread's kind."""
    out: concurrent.futures.Future = concurrent.futures.Future()

    def run() -> None:
        try:
            out.set_result(fn(arg))
        except Exception as exc:  # the port answers None for each, and logs it
            out.set_exception(exc)

    loop.call_soon_threadsafe(run)
    return out
