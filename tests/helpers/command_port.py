"""A test's own line to a worker's command port, the one way commands reach a worker (the scheduler's
WorkerMail speaks the same frames, batched per tick): commands sent, reservations asked and answered."""

from __future__ import annotations

import zmq

from actors.protocol.codec import decode_reserved, encode
from actors.protocol.messages import KvReservation
from actors.protocol.worker_commands import Commands, Reserve, ReserveBlocks, WorkerCommand


class CommandLine:
    def __init__(self, endpoint: str):
        self._socket = zmq.Context.instance().socket(zmq.DEALER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.connect(endpoint)
        self._asks = 0

    def send(self, *commands: WorkerCommand) -> None:
        self._socket.send(encode(Commands(commands)))

    def reserve(self, *asks: ReserveBlocks, timeout_s: float = 30.0) -> tuple[KvReservation | None, ...]:
        """The answers, in order; raises when none comes within `timeout_s`."""
        self._asks += 1
        self._socket.send(encode(Reserve(self._asks, asks)))
        if not self._socket.poll(int(timeout_s * 1000)):
            raise TimeoutError(f"no answer to a reservation within {timeout_s}s")
        answer = decode_reserved(self._socket.recv())
        assert answer.ask == self._asks, answer
        return answer.reservations

    def close(self) -> None:
        self._socket.close(linger=0)
