"""The scheduler's port for per-request traffic: one zmq ROUTER socket on the scheduler's event loop,
taking its clients' `SubmitBatch` and `AbortRequests` frames and its worker processes' `Reports`
(scheduler_wire.py), and sending each peer its answers (decisions batched per tick).

Why not Ray calls: one costs about what a whole placement decision does (~0.6 ms of the scheduler's CPU
on a small box, most of it pickling and Ray's own machinery), so at thousands of requests per second
the calls, not the decisions, were the scheduler's work. Ray still places and restarts the scheduler,
and clients find this socket through it (`Scheduler.client_port`).

The trust model is the KV plane's: CURVE with the cluster's keys when it has them, a bounded frame size
(a bigger frame disconnects its sender), and a receive loop that drops and counts whatever is not a
well-formed frame, then goes on with the next.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

import zmq
import zmq.asyncio

from actors.protocol.scheduler_wire import (
    AbortRequests,
    AbortsTaken,
    Answer,
    Answers,
    Reports,
    ReportsTaken,
    Submit,
    SubmitBatch,
)
from actors.protocol.codec import MAX_MESSAGE_BYTES, ProtocolError, decode_to_scheduler, encode
from actors.protocol.messages import Admitted, GenerateRequest, Rejected, WorkerReport
from kv_transfer.curve import CurveKeys, secure_server
from kv_transfer.drops import DropCounter
from kv_transfer.endpoints import advertised_host

log = logging.getLogger("tandem.scheduler")
_SEND_HWM = 1_000_000  # answers queued for one client before they are dropped (it resends what it misses)


class ClientPort:
    def __init__(self, submit: Callable[[GenerateRequest], Awaitable[Admitted | Rejected]],
                 abort: Callable[[str], Awaitable[bool]], take_reports: Callable[[tuple[WorkerReport, ...]], tuple[str, ...]],
                 keys: CurveKeys | None, host: str = "127.0.0.1"):
        """`take_reports` answers with the reporting workers the scheduler does not know."""
        self._submit, self._abort, self._take_reports = submit, abort, take_reports
        self._socket = zmq.asyncio.Context(zmq.Context.instance()).socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        self._socket.setsockopt(zmq.SNDHWM, _SEND_HWM)
        secure_server(self._socket, keys)
        port = self._socket.bind_to_random_port(f"tcp://{host}")
        self.endpoint = f"tcp://{advertised_host(host)}:{port}"
        self.drops = DropCounter("client_port")
        self._outgoing: dict[bytes, list[Answer]] = {}  # client identity -> this tick's answers
        self._flush_pending = False
        self.frames_in = self.frames_out = 0  # for the control-plane benchmark
        self._task = asyncio.get_running_loop().create_task(self._receive())

    async def _receive(self) -> None:
        while True:
            try:
                frames = await self._socket.recv_multipart(copy=False)
                self._take(frames)
            except Exception as exc:  # whatever one frame did, the next is still read (a cancel is not an Exception)
                if not self.drops.survived(exc):
                    return

    def _take(self, frames) -> None:
        if len(frames) != 2:
            self.drops.drop("malformed", f"{len(frames)} frames")
            return
        identity = frames[0].bytes
        try:
            message = decode_to_scheduler(frames[1].buffer)
        except ProtocolError as exc:
            self.drops.drop("malformed", exc)
            return
        self.frames_in += 1
        loop = asyncio.get_running_loop()
        match message:
            case SubmitBatch(submits=submits):
                for submit in submits:
                    loop.create_task(self._decide(identity, submit))
            case AbortRequests(ask=ask, request_ids=request_ids):
                loop.create_task(self._aborts(identity, ask, request_ids))
            case Reports(ask=ask, reports=reports):
                self._send(identity, ReportsTaken(ask, self._take_reports(reports)))

    async def _decide(self, identity: bytes, submit: Submit) -> None:
        try:
            decision = await self._submit(submit.request)
        except Exception as exc:  # a bug in one admission must not cost the client its answer
            log.exception("admitting a request failed")
            decision = Rejected(f"internal error while admitting the request: {type(exc).__name__}: {exc}", None)
        self._outgoing.setdefault(identity, []).append(Answer.of(submit.ask, decision))
        if not self._flush_pending:
            self._flush_pending = True
            asyncio.get_running_loop().call_soon(self._flush)

    async def _aborts(self, identity: bytes, ask: int, request_ids: tuple[str, ...]) -> None:
        for request_id in request_ids:
            await self._abort(request_id)
        self._send(identity, AbortsTaken(ask))

    def _flush(self) -> None:
        self._flush_pending = False
        outgoing, self._outgoing = self._outgoing, {}
        for identity, answers in outgoing.items():
            self._send(identity, Answers(tuple(answers)))

    def _send(self, identity: bytes, message: Answers | AbortsTaken | ReportsTaken) -> None:
        # A ROUTER never waits to send: past a client's high-water mark (it reads nothing) or to a client
        # that left, zmq drops the frame; the client asks again once it reconnects.
        self._socket.send_multipart((identity, encode(message))).add_done_callback(self._sent)

    def _sent(self, future: asyncio.Future) -> None:
        if future.cancelled() or future.exception() is not None:
            self.drops.drop("error", "an answer could not be sent" if future.cancelled() else future.exception())
        else:
            self.frames_out += 1

    def close(self) -> None:
        self._task.cancel()
        self._socket.close(linger=0)
