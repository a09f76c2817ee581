"""A client's token sink: the one PULL socket workers push token deltas to, and the thread that reads it.

Workers push one message per engine step; the receiving thread hands each delta to its request's inbox
(`inbox_of`: the request id's inbox, or None for a request the client no longer listens to). With the
cluster's CURVE keys only its workers and scheduler can connect; whatever arrives that is not a list of
token deltas is dropped and counted, and only `close` (or the `kill` chaos hook) ends the thread.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import zmq

from actors.protocol.codec import MAX_MESSAGE_BYTES, ProtocolError, decode_deltas
from kv_transfer.curve import CurveKeys, secure_server
from kv_transfer.drops import DropCounter
from kv_transfer.endpoints import advertised_host


class TokenSink:
    def __init__(self, host: str, keys: CurveKeys | None, inbox_of: Callable[[str], object | None]):
        self._socket = zmq.Context.instance().socket(zmq.PULL)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)  # a bigger one disconnects its sender
        secure_server(self._socket, keys)
        port = self._socket.bind_to_random_port(f"tcp://{host}")
        self.endpoint = f"tcp://{advertised_host(host)}:{port}"  # workers on other nodes connect to it
        self.drops = DropCounter("token_sink")
        self._inbox_of = inbox_of
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._receive, name="tandem-client-sink", daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def kill(self) -> None:
        """End the receiving thread as a crash would; the socket stays bound."""
        self._stop.set()
        self._thread.join(timeout=5)

    def close(self) -> None:
        self.kill()
        self._socket.close(linger=0)

    def _receive(self) -> None:
        poller = zmq.Poller()
        poller.register(self._socket, zmq.POLLIN)
        while not self._stop.is_set():
            try:
                if poller.poll(100):
                    self._deliver(self._socket.recv())
            except Exception as exc:  # whatever one message did, the next is still delivered
                if not self.drops.survived(exc):
                    return

    def _deliver(self, payload: bytes) -> None:
        try:
            deltas = decode_deltas(payload)
        except ProtocolError as exc:  # garbage on the sink costs that message, never the stream
            self.drops.drop("malformed", exc)
            return
        for delta in deltas:
            inbox = self._inbox_of(delta.attempt.request_id)
            if inbox is not None:
                inbox.put(delta)
