"""A client's link to one scheduler shard: submits and aborts over zmq (a DEALER to the scheduler's
ROUTER, client_port.py), on the client's own event loop.

The submits of one event-loop tick travel in one frame; the answers come back as they are decided,
batched per scheduler tick. Ray still tells where the scheduler listens and which incarnation it is
(`Scheduler.client_port`): while anything is unanswered the link asks it every `_PROBE_S`, and when
the scheduler restarted (another incarnation) it connects to the new one and sends every unanswered
ask again (a submit marked `retried`: admitted at most once; an abort is idempotent). A caller that
waits too long gives up on its own (its timeout); its ask is then forgotten here.

The receive loop drops and counts whatever is not a well-formed frame from the scheduler.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from dataclasses import replace

import ray
import zmq
import zmq.asyncio

from actors.protocol.scheduler_wire import AbortRequests, AbortsTaken, Answers, Submit, SubmitBatch
from actors.protocol.codec import MAX_MESSAGE_BYTES, ProtocolError, decode_to_client, encode
from actors.protocol.messages import Admitted, GenerateRequest, Rejected, SchedulerPort
from kv_transfer.curve import CurveKeys, secure_client
from kv_transfer.drops import DropCounter

log = logging.getLogger("tandem.client")
_PROBE_S = 1.0  # how often a link with unanswered asks checks that its scheduler is the same one
_RETRY_S = 0.1  # after Ray said the scheduler is restarting: the asks wait for it, so ask again soon
_ASK_TIMEOUT_S = 10.0  # for Ray's answer about where the scheduler listens


class SchedulerLink:
    def __init__(self, scheduler, keys: CurveKeys | None, drops: DropCounter):
        self._scheduler = scheduler  # the shard's Ray actor handle
        self._keys = keys
        self.drops = drops
        self._context = zmq.asyncio.Context(zmq.Context.instance())
        self._socket: zmq.asyncio.Socket | None = None
        self._receiver: asyncio.Task | None = None
        self._watch: asyncio.Task | None = None
        self.port: SchedulerPort | None = None  # where the incarnation this link talks to listens
        self._connecting: asyncio.Lock | None = None
        self._asks = itertools.count()
        self._submits: dict[int, tuple[GenerateRequest, asyncio.Future]] = {}
        self._aborts: dict[int, tuple[tuple[str, ...], asyncio.Future]] = {}
        self._tick: list[Submit] = []

    async def submit(self, request: GenerateRequest) -> Admitted | Rejected:
        """The scheduler's decision; raises what asking Ray where the scheduler is raised (it is down)."""
        await self._connected()
        ask = next(self._asks)
        future = asyncio.get_running_loop().create_future()
        self._submits[ask] = (request, future)
        self._tick.append(Submit(ask, request))
        if len(self._tick) == 1:
            asyncio.get_running_loop().call_soon(self._flush)
        self._watching()
        try:
            return await future
        finally:
            self._submits.pop(ask, None)

    async def abort(self, request_ids: tuple[str, ...]) -> None:
        """Returns once the scheduler took the aborts."""
        await self._connected()
        ask = next(self._asks)
        future = asyncio.get_running_loop().create_future()
        self._aborts[ask] = (request_ids, future)
        self._send(AbortRequests(ask, request_ids))
        self._watching()
        try:
            await future
        finally:
            self._aborts.pop(ask, None)

    def _flush(self) -> None:
        tick, self._tick = self._tick, []
        if tick:
            self._send(SubmitBatch(tuple(tick)))

    def _send(self, message: SubmitBatch | AbortRequests) -> None:
        # A DEALER queues what it cannot send yet; what a dead scheduler never answered is sent again to
        # its successor (`_reconnect`).
        self._socket.send(encode(message)).add_done_callback(self._sent)

    def _sent(self, future: asyncio.Future) -> None:
        if not future.cancelled() and future.exception() is not None:  # (cancelled: its socket was replaced)
            self.drops.drop("error", future.exception())

    # ---- the scheduler, as Ray knows it ----

    async def _connected(self) -> None:
        if self.port is None:
            await self._reconnect()

    async def _reconnect(self) -> None:
        if self._connecting is None:
            self._connecting = asyncio.Lock()
        async with self._connecting:
            try:
                port: SchedulerPort = await asyncio.wait_for(self._scheduler.client_port.remote(), _ASK_TIMEOUT_S)
            except asyncio.TimeoutError:  # (the caller's own timeout is another matter: not this one)
                raise ray.exceptions.GetTimeoutError(f"Ray did not say within {_ASK_TIMEOUT_S:.0f}s where the "
                                                     "scheduler listens") from None
            if port == self.port:
                return
            restarted = self.port is not None
            self._close_socket()
            self._socket = self._context.socket(zmq.DEALER)
            self._socket.setsockopt(zmq.LINGER, 0)
            self._socket.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
            secure_client(self._socket, self._keys)
            self._socket.connect(port.endpoint)
            self.port = port
            self._receiver = asyncio.get_running_loop().create_task(self._receive(self._socket))
            if restarted:
                self._ask_again()

    def _ask_again(self) -> None:
        """Everything unanswered, to a scheduler that restarted: its predecessor may have taken it or not."""
        if self._submits or self._aborts:
            log.warning("scheduler restarted (now %s): asking again %d submits and %d aborts",
                        self.port.epoch, len(self._submits), len(self._aborts))
        self._tick = []
        submits = tuple(Submit(ask, replace(request, retried=True)) for ask, (request, _) in self._submits.items())
        if submits:
            self._send(SubmitBatch(submits))
        for ask, (request_ids, _) in self._aborts.items():
            self._send(AbortRequests(ask, request_ids))

    def _watching(self) -> None:
        if self._watch is None or self._watch.done():
            self._watch = asyncio.get_running_loop().create_task(self._watch_scheduler())

    async def _watch_scheduler(self) -> None:
        wait_s = _PROBE_S
        while self._submits or self._aborts:
            await asyncio.sleep(wait_s)
            wait_s = _PROBE_S
            try:
                await self._reconnect()
            except ray.exceptions.RayError:
                wait_s = _RETRY_S  # it is restarting: ask again soon
            except Exception:  # the watch must outlive anything one round does
                log.exception("checking the scheduler failed")

    # ---- answers ----

    async def _receive(self, socket: zmq.asyncio.Socket) -> None:
        while True:
            try:
                payload = await socket.recv(copy=False)
                self._take(payload.buffer)
            except Exception as exc:  # whatever one frame did, the next is still read (a cancel is not an Exception)
                if not self.drops.survived(exc):
                    return

    def _take(self, payload) -> None:
        try:
            message = decode_to_client(payload)
        except ProtocolError as exc:
            self.drops.drop("malformed", exc)
            return
        match message:
            case Answers(answers=answers):
                for answer in answers:
                    waiting = self._submits.get(answer.ask)
                    if waiting is not None and not waiting[1].done():
                        waiting[1].set_result(answer.decision)
            case AbortsTaken(ask=ask):
                waiting = self._aborts.get(ask)
                if waiting is not None and not waiting[1].done():
                    waiting[1].set_result(None)

    def _close_socket(self) -> None:
        if self._receiver is not None:
            self._receiver.cancel()
        if self._socket is not None:
            self._socket.close(linger=0)

    async def close(self) -> None:
        tasks = [t for t in (self._receiver, self._watch) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._close_socket()
