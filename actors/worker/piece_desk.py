"""How the ranks of a tensor-parallel decode worker share one handoff table: each rank's KV receiver
writes into that rank's cache, but only rank 0 keeps leases. A rank r > 0 asks rank 0's `PieceDesk`
before it writes a piece (admit, answered at once) and tells it how the write ended; rank 0 adopts the
attempt once every rank's heads have landed.

Local zmq over ipc: the ranks of a group share a node (STRICT_PACK), and the socket file sits in a
directory only this user can enter. The desk's loop survives any bytes (dropped and counted); a rank
that gets no verdict within `VERDICT_TIMEOUT_S` writes nothing and reports the piece failed, so a piece
rank 0 admitted is always reported once.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
import threading
import time
from typing import Callable

import zmq

from actors.protocol.codec import ProtocolError, decode_as, encode
from actors.protocol.tp_messages import KvPiece, PieceEvent, PieceVerdict
from actors.worker.handoff_table import LeaseRefused
from kv_transfer.drops import DropCounter
from kv_transfer.page_format import PageFormatError

log = logging.getLogger("tandem.worker")
VERDICT_TIMEOUT_S = 30.0


class PieceDesk:
    """Rank 0's end: answers the other ranks' admits with `admit(piece)` (the handoff table's) and passes
    their pieces' outcomes to `on_piece`, both on its own thread."""

    def __init__(self, admit: Callable[[KvPiece], None], on_piece: Callable[[PieceEvent], None]):
        self._admit, self._on_piece = admit, on_piece
        self._dir = tempfile.mkdtemp(prefix="tandem-desk-")
        self.address = f"ipc://{self._dir}/desk.sock"
        self._sock = zmq.Context.instance().socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.MAXMSGSIZE, 1 << 20)
        self._sock.bind(self.address)
        self.drops = DropCounter("piece_desk")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tp-piece-desk", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        shutil.rmtree(self._dir, ignore_errors=True)

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                if self._sock.poll(50, zmq.POLLIN):
                    self._serve(self._sock.recv_multipart())
        finally:
            self._sock.close(linger=0)

    def _serve(self, frames: list[bytes]) -> None:
        if len(frames) != 2:
            self.drops.drop("malformed", ValueError(f"{len(frames)} frames"))
            return
        identity, payload = frames
        try:
            event = decode_as(PieceEvent, payload)
        except ProtocolError as exc:
            self.drops.drop("malformed", exc)
            return
        if event.stage != "admit":
            self._on_piece(event)
            return
        verdict = PieceVerdict(event.piece)
        try:
            self._admit(event.piece)
        except LeaseRefused as exc:
            verdict = PieceVerdict(event.piece, str(exc), ended=True)
        except PageFormatError as exc:
            verdict = PieceVerdict(event.piece, str(exc))
        self._sock.send_multipart([identity, encode(verdict)])


class DeskClient:
    """A rank r > 0's end; used only from that rank's KV receiving thread (zmq sockets are not thread-safe)."""

    def __init__(self, address: str):
        self._sock = zmq.Context.instance().socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 1000)
        self._sock.connect(address)

    def admit(self, piece: KvPiece) -> None:
        """Raises LeaseRefused (drop it quietly) or PageFormatError (refuse it: the attempt fails)."""
        self._sock.send(encode(PieceEvent(piece, "admit")))
        verdict = self._verdict(piece)
        if verdict is None:  # rank 0 may have admitted it after all: saying it failed ends that admission
            self.report(PieceEvent(piece, "failed", "no verdict from rank 0"))
            raise LeaseRefused(f"transfer {piece.lease_id}: no verdict from rank 0 within {VERDICT_TIMEOUT_S}s")
        if verdict.error:
            raise (LeaseRefused if verdict.ended else PageFormatError)(verdict.error)

    def _verdict(self, piece: KvPiece) -> PieceVerdict | None:
        """The answer to this admit; a late answer to an earlier one (it timed out) is skipped."""
        deadline = time.monotonic() + VERDICT_TIMEOUT_S
        while (left := deadline - time.monotonic()) > 0 and self._sock.poll(int(left * 1000) + 1, zmq.POLLIN):
            try:
                verdict = decode_as(PieceVerdict, self._sock.recv())
            except ProtocolError:
                continue
            if verdict.piece == piece:
                return verdict
        return None

    def report(self, event: PieceEvent) -> None:
        self._sock.send(encode(event))

    def close(self) -> None:
        self._sock.close()
