"""The token stream from workers to the client side: one zmq message per engine step per sink.

Messages are `TokenDelta` lists in the protocol codec (`actors.protocol.codec.decode_deltas` reads them).

A worker groups the new tokens of every request it touched in a step by the request's sink (the
client's PULL endpoint) and pushes one message to each sink. `offset` is the number of output
tokens before this delta, so a client can put deltas from two workers (the first token from the
prefill worker, the rest from the decode worker) back in order.
"""

from __future__ import annotations

import threading

import zmq

from actors.protocol.codec import encode
from actors.protocol.messages import TokenDelta
from kv_transfer.curve import CurveKeys, secure_client


class TokenPublisher:
    """PUSH sockets to client sinks, one per sink, used by one thread at a time.

    A sink that stops reading (a client that went away) never blocks the engine: once its queue is
    full, messages to it are dropped and counted.
    """

    def __init__(self, context: zmq.Context | None = None, high_water_mark: int = 100_000, keys: CurveKeys | None = None):
        self._context = context or zmq.Context.instance()
        self._keys = keys
        self._sockets: dict[str, zmq.Socket] = {}
        self._hwm = high_water_mark
        self._lock = threading.Lock()
        self.dropped = 0

    def publish(self, sink: str, deltas: list[TokenDelta]) -> None:
        with self._lock:
            sock = self._sockets.get(sink)
            if sock is None:
                sock = self._context.socket(zmq.PUSH)
                sock.setsockopt(zmq.LINGER, 0)
                sock.setsockopt(zmq.SNDHWM, self._hwm)
                secure_client(sock, self._keys)
                sock.connect(sink)
                self._sockets[sink] = sock
            try:
                sock.send(encode(deltas), flags=zmq.NOBLOCK)
            except zmq.Again:
                self.dropped += 1

    def close(self, linger_s: float = 0.0) -> None:
        with self._lock:
            for sock in self._sockets.values():
                sock.close(linger=int(linger_s * 1000))
            self._sockets.clear()
