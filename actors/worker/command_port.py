"""A worker process's command port: the zmq ROUTER the scheduler sends its batched commands and
reservations to (worker_commands.py), on a thread of its own.

`Commands` are handed on as they arrive; a `Reserve` is handed on at once too (so that a later abort
cannot overtake it), and its answer goes back when every reservation in it is decided: the answering
side returns a future, completed on whatever thread decides it, and the port's thread sends the answer
(a zmq socket is one thread's) when a pipe wakes it. The trust model is the other ports': CURVE with the
cluster's keys, bounded frames, and a receive loop that drops and counts garbage and goes on.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future

import zmq

from actors.protocol.codec import MAX_MESSAGE_BYTES, ProtocolError, decode_to_worker, encode
from actors.protocol.messages import KvReservation
from actors.protocol.worker_commands import Commands, Reserve, ReserveBlocks, Reserved, WorkerCommand
from kv_transfer.curve import CurveKeys, secure_server
from kv_transfer.drops import DropCounter
from kv_transfer.endpoints import advertised_host

log = logging.getLogger("tandem.worker")


class CommandPort:
    def __init__(self, deliver: Callable[[tuple[WorkerCommand, ...]], None],
                 reserve: Callable[[tuple[ReserveBlocks, ...]], Future], keys: CurveKeys | None,
                 host: str = "127.0.0.1", name: str = "worker"):
        """`reserve` returns a future of the answers, in order (None where there is no room)."""
        self._deliver, self._reserve = deliver, reserve
        self._socket = zmq.Context.instance().socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        secure_server(self._socket, keys)
        port = self._socket.bind_to_random_port(f"tcp://{host}")
        self.endpoint = f"tcp://{advertised_host(host)}:{port}"
        self.drops = DropCounter("command_port")
        self._answers: queue.SimpleQueue = queue.SimpleQueue()  # (identity, Reserved) to send
        self._wake_read, self._wake_write = os.pipe()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"commands-{name}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._socket, zmq.POLLIN)
        poller.register(self._wake_read, zmq.POLLIN)
        while not self._stop.is_set():
            try:
                ready = dict(poller.poll(100))
                if self._wake_read in ready:
                    os.read(self._wake_read, 4096)
                self._send_answers()
                if self._socket in ready:
                    while True:  # everything that arrived, before polling again
                        try:
                            frames = self._socket.recv_multipart(flags=zmq.NOBLOCK, copy=False)
                        except zmq.Again:
                            break
                        self._take(frames)
            except zmq.ZMQError as exc:
                if exc.errno in (zmq.ETERM, zmq.ENOTSOCK) or self._stop.is_set():
                    return
                self.drops.drop("error", exc)
            except Exception as exc:  # whatever one frame did, the next is still read
                self.drops.drop("error", exc, exc_info=True)

    def _take(self, frames) -> None:
        if len(frames) != 2:
            self.drops.drop("malformed", f"{len(frames)} frames")
            return
        identity = frames[0].bytes
        try:
            message = decode_to_worker(frames[1].buffer)
        except ProtocolError as exc:
            self.drops.drop("malformed", exc)
            return
        match message:
            case Commands(commands=commands):
                self._deliver(commands)
            case Reserve(ask=ask, asks=asks):
                self._reserve(asks).add_done_callback(lambda done: self._answered(identity, ask, len(asks), done))

    def _answered(self, identity: bytes, ask: int, count: int, done: Future) -> None:
        """On whatever thread decided the reservations."""
        try:
            reservations: tuple[KvReservation | None, ...] = tuple(done.result())
        except Exception:
            log.exception("reservations failed")
            reservations = (None,) * count
        self._answers.put((identity, Reserved(ask, reservations)))
        try:
            os.write(self._wake_write, b"!")
        except OSError:  # closed: nobody is left to answer
            pass

    def _send_answers(self) -> None:
        while True:
            try:
                identity, answer = self._answers.get_nowait()
            except queue.Empty:
                return
            try:
                self._socket.send_multipart((identity, encode(answer)), flags=zmq.NOBLOCK)
            except zmq.Again:  # the scheduler reads nothing: it gives up on the reservation by itself
                self.drops.drop("full", "a reservation answer could not be queued")

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._socket.close(linger=0)
        for fd in (self._wake_read, self._wake_write):
            os.close(fd)
