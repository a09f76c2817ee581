"""A worker process's reports to its scheduler over zmq: a DEALER to the scheduler's port (the one its
clients submit to, cluster/control/scheduler/client_port.py), one `Reports` frame per heartbeat with the
reports of every worker the process hosts (one for a real worker, many for a simulated host).

One report is out at a time: the next is built only once the scheduler answered (`ready`), so a slow
scheduler gets fewer, fuller reports instead of a backlog of stale ones, and nothing a report would
carry (finished attempts, handoffs) is taken from the worker before it can go. An answer names the
workers the scheduler does not know (it restarted, or gave up on them): they register again, through
Ray. A report unanswered for `_LOST_S` counts as lost, and the link asks Ray again where the scheduler
listens (a restarted one listens elsewhere). Never blocks: the engine thread calls it between steps.
"""

from __future__ import annotations

import itertools
import time

import ray
import zmq

from actors.protocol.scheduler_wire import Reports, ReportsTaken
from actors.protocol.codec import MAX_MESSAGE_BYTES, ProtocolError, decode_to_client, encode
from actors.protocol.messages import SchedulerPort, WorkerReport
from kv_transfer.curve import CurveKeys, secure_client
from kv_transfer.drops import DropCounter

_LOST_S = 1.0
_RETRY_S = 0.1  # after Ray said the scheduler is restarting: soon, so a restart costs the workers no extra second


class ReportLink:
    def __init__(self, scheduler, keys: CurveKeys | None, clock=time.monotonic):
        self._scheduler = scheduler  # the Ray actor handle: where it listens, and registration
        self._keys = keys
        self._clock = clock
        self._context = zmq.Context.instance()
        self._socket: zmq.Socket | None = None
        self.port: SchedulerPort | None = None
        self._asking = scheduler.client_port.remote()  # Ray's answer about where it listens, while pending
        self._ask_again_at: float | None = None  # when to ask again, after Ray could not say
        self._asks = itertools.count()
        self._out: int | None = None  # the report frame not answered yet
        self._sent_at = 0.0
        self._unknown: set[str] = set()
        self.drops = DropCounter("report_link")

    def ready(self) -> bool:
        """Whether a report may go now (connected, and the last one answered or lost)."""
        self._poll()
        if self._ask_again_at is not None and self._clock() >= self._ask_again_at:
            self._ask_where()
        if self._socket is None:
            return False
        if self._out is not None and self._clock() - self._sent_at >= _LOST_S:
            self._out = None  # lost (or the scheduler is that slow): ask where it listens, and go on reporting
            self._ask_where()
        return self._out is None

    def send(self, reports: tuple[WorkerReport, ...]) -> None:
        ask = next(self._asks)
        try:
            self._socket.send(encode(Reports(ask, reports)), flags=zmq.NOBLOCK)
        except zmq.Again:  # the scheduler is gone and the pipe is full: the next report says it all again
            self.drops.drop("full", "a report could not be queued")
            return
        self._out, self._sent_at = ask, self._clock()

    def take_unknown(self) -> set[str]:
        """Workers the scheduler said it does not know, since the last call."""
        self._poll()
        unknown, self._unknown = self._unknown, set()
        return unknown

    def _ask_where(self) -> None:
        if self._asking is None:
            self._asking, self._ask_again_at = self._scheduler.client_port.remote(), None

    def _poll(self) -> None:
        if self._asking is not None and _done(self._asking):
            asking, self._asking = self._asking, None
            try:
                port = ray.get(asking, timeout=0)
            except ray.exceptions.RayError:  # dead or restarting: ask again shortly
                port, self._ask_again_at = None, self._clock() + _RETRY_S
            if port is not None and port != self.port:
                self._connect(port)
        while self._socket is not None:
            try:
                payload = self._socket.recv(flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            self._take(payload.buffer)

    def _take(self, payload) -> None:
        try:
            message = decode_to_client(payload)
        except ProtocolError as exc:
            self.drops.drop("malformed", exc)
            return
        if not isinstance(message, ReportsTaken):
            self.drops.drop("refused", type(message).__name__)
            return
        self._unknown.update(message.unknown)
        if message.ask == self._out:
            self._out = None

    def _connect(self, port: SchedulerPort) -> None:
        self.close()
        self._socket = self._context.socket(zmq.DEALER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        self._socket.setsockopt(zmq.SNDHWM, 16)  # a few reports at most wait for a scheduler that is gone
        secure_client(self._socket, self._keys)
        self._socket.connect(port.endpoint)
        self.port = port
        self._out = None

    def close(self) -> None:
        if self._socket is not None:
            self._socket.close(linger=0)
            self._socket = None


def _done(ref) -> bool:
    ready, _ = ray.wait([ref], timeout=0)
    return bool(ready)
