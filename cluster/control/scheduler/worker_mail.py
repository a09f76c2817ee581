"""The scheduler's commands to workers, batched: every command for the workers one process hosts goes
out in one `Commands` frame, every reservation in one `Reserve` frame, to the process's command port
(actors/worker/command_port.py) over zmq, when the event loop finishes the callbacks of the current
iteration, or, under load, at most every `_MIN_GAP_S` (a command sent while the mail is quiet waits for
nothing).

Why not Ray calls: one costs about as much CPU as a whole placement decision (~0.6 ms here), most of it
pickling and Ray's own machinery. One DEALER socket per worker process keeps the order of what is sent
to it: a process's commands of one tick arrive in the order they were sent, and before those of later
ticks. A reservation whose answer does not come within `reserve_timeout_s`, or whose worker is gone,
fails (`MailLost`): the caller places the request again.
"""

from __future__ import annotations

import asyncio
import itertools

import zmq
import zmq.asyncio

from actors.protocol.codec import MAX_MESSAGE_BYTES, ProtocolError, decode_reserved, encode
from actors.protocol.worker_commands import Commands, Reserve, ReserveBlocks, WorkerCommand
from kv_transfer.curve import CurveKeys, secure_client
from kv_transfer.drops import DropCounter

_MIN_GAP_S = 0.002
_SEND_HWM = 100_000  # frames queued for a worker process that is gone, before they are dropped


class MailLost(RuntimeError):
    """A reservation got no answer: its worker is gone, or did not answer in time."""


class WorkerMail:
    def __init__(self, reserve_timeout_s: float, keys: CurveKeys | None):
        self._reserve_timeout_s = reserve_timeout_s
        self._keys = keys
        self._context = zmq.asyncio.Context(zmq.Context.instance())
        self._sockets: dict[str, zmq.asyncio.Socket] = {}  # command endpoint -> DEALER
        self._receivers: dict[str, asyncio.Task] = {}
        self._commands: dict[str, list[WorkerCommand]] = {}  # command endpoint -> this tick's commands
        self._asks: dict[str, list[tuple[ReserveBlocks, asyncio.Future]]] = {}
        self._waiting: dict[int, tuple[str, list[tuple[ReserveBlocks, asyncio.Future]]]] = {}  # Reserve frames out
        self._ask_ids = itertools.count()
        self._flush_pending = False
        self._flushed_at = 0.0
        self.drops = DropCounter("worker_mail")
        self.calls = 0  # frames sent to workers (for the control-plane benchmark)
        self.commands = 0

    def send(self, endpoint: str, command: WorkerCommand) -> None:
        self._commands.setdefault(endpoint, []).append(command)
        self._schedule()

    def reserve(self, endpoint: str, ask: ReserveBlocks) -> asyncio.Future:
        """Resolves to the worker's `KvReservation` or None (no room); raises `MailLost`."""
        future = asyncio.get_running_loop().create_future()
        self._asks.setdefault(endpoint, []).append((ask, future))
        self._schedule()
        return future

    def _schedule(self) -> None:
        if not self._flush_pending:
            self._flush_pending = True
            loop = asyncio.get_running_loop()
            wait = self._flushed_at + _MIN_GAP_S - loop.time()
            if wait > 0:
                loop.call_later(wait, self._flush)
            else:
                loop.call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_pending = False
        loop = asyncio.get_running_loop()
        self._flushed_at = loop.time()
        commands, self._commands = self._commands, {}
        asks, self._asks = self._asks, {}
        for endpoint, batch in commands.items():
            self._send(endpoint, Commands(tuple(batch)))
            self.commands += len(batch)
        for endpoint, batch in asks.items():
            ask = next(self._ask_ids)
            self._waiting[ask] = (endpoint, batch)
            self._send(endpoint, Reserve(ask, tuple(a for a, _ in batch)))
            self.commands += len(batch)
            loop.call_later(self._reserve_timeout_s, self._fail, ask, "no answer in time")

    def _send(self, endpoint: str, message: Commands | Reserve) -> None:
        socket = self._sockets.get(endpoint)
        if socket is None:
            socket = self._sockets[endpoint] = self._context.socket(zmq.DEALER)
            socket.setsockopt(zmq.LINGER, 0)
            socket.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
            socket.setsockopt(zmq.SNDHWM, _SEND_HWM)
            secure_client(socket, self._keys)
            socket.connect(endpoint)
            self._receivers[endpoint] = asyncio.get_running_loop().create_task(self._receive(socket))
        socket.send(encode(message), flags=zmq.NOBLOCK).add_done_callback(self._sent)
        self.calls += 1

    def _sent(self, future: asyncio.Future) -> None:
        if future.cancelled() or future.exception() is None:
            return
        # zmq.Again: that process is long gone and its queue is full: its reservations fail by their
        # timeout, its commands die with it.
        self.drops.drop("full" if isinstance(future.exception(), zmq.Again) else "error", future.exception())

    async def _receive(self, socket: zmq.asyncio.Socket) -> None:
        while True:
            try:
                payload = await socket.recv(copy=False)
                answer = decode_reserved(payload.buffer)
            except asyncio.CancelledError:
                raise
            except ProtocolError as exc:
                self.drops.drop("malformed", exc)
                continue
            except zmq.ZMQError as exc:
                if exc.errno in (zmq.ETERM, zmq.ENOTSOCK):
                    return
                self.drops.drop("error", exc)
                continue
            waiting = self._waiting.pop(answer.ask, None)
            if waiting is None:
                continue  # it timed out, or its worker was declared gone
            for (_, future), reservation in zip(waiting[1], answer.reservations):
                if not future.done():  # (its waiter may have been cancelled)
                    future.set_result(reservation)
            for _, future in waiting[1][len(answer.reservations):]:
                if not future.done():
                    future.set_exception(MailLost("the worker answered fewer reservations than asked"))

    def _fail(self, ask: int, why: str) -> None:
        waiting = self._waiting.pop(ask, None)
        if waiting is None:
            return
        for _, future in waiting[1]:
            if not future.done():
                future.set_exception(MailLost(f"reservation on {waiting[0]}: {why}"))

    def worker_gone(self, worker_id: str) -> None:
        """Its reservations waiting for an answer fail now (a dead process never answers)."""
        for ask, (_, batch) in list(self._waiting.items()):
            if any(a.worker_id == worker_id for a, _ in batch):
                for a, future in batch:
                    if a.worker_id == worker_id and not future.done():
                        future.set_exception(MailLost(f"worker {worker_id} is gone"))

    def keep_only(self, endpoints: set[str]) -> None:
        """Close the sockets to processes no registered worker lives in (each restart binds a new port)."""
        for endpoint in set(self._sockets) - endpoints:
            self._receivers.pop(endpoint).cancel()
            self._sockets.pop(endpoint).close(linger=0)
            for ask, (where, _) in list(self._waiting.items()):
                if where == endpoint:
                    self._fail(ask, "its process is gone")

    def sockets(self) -> int:
        return len(self._sockets)
