"""The one encoder for messages that travel over zmq (Ray pickles the control messages itself).

Decoding is typed: bytes that are not exactly the expected message raise `ProtocolError`, so a receive
loop can drop and count garbage instead of dying of it or passing a half-formed message on.
"""

from __future__ import annotations

import msgspec

from actors.protocol.scheduler_wire import ToClient, ToScheduler
from actors.protocol.messages import HandoffNote, TokenDelta
from actors.protocol.tp_messages import KvSendPlan, PieceEvent, PieceVerdict
from actors.protocol.worker_commands import Reserved, ToWorker

MAX_MESSAGE_BYTES = 64 << 20  # a step's deltas for a whole batch are far smaller; anything bigger is garbage


class ProtocolError(ValueError):
    """Bytes that are not a well-formed message of the expected type."""


_encoder = msgspec.msgpack.Encoder()
_deltas = msgspec.msgpack.Decoder(list[TokenDelta])
_note = msgspec.msgpack.Decoder(HandoffNote)
_decoders = {t: msgspec.msgpack.Decoder(t) for t in (KvSendPlan, PieceEvent, PieceVerdict)}
_to_scheduler = msgspec.msgpack.Decoder(ToScheduler)
_to_client = msgspec.msgpack.Decoder(ToClient)
_to_worker = msgspec.msgpack.Decoder(ToWorker)
_reserved = msgspec.msgpack.Decoder(Reserved)


def encode(message) -> bytes:
    return _encoder.encode(message)


def decode_deltas(payload: bytes) -> list[TokenDelta]:
    return _decode(_deltas, payload)


def decode_note(payload: bytes) -> HandoffNote:
    return _decode(_note, payload)


def decode_to_scheduler(payload: bytes) -> ToScheduler:
    """A client's frame to its scheduler (scheduler_wire.py)."""
    return _decode(_to_scheduler, payload)


def decode_to_client(payload: bytes) -> ToClient:
    """A scheduler's frame to a client (scheduler_wire.py)."""
    return _decode(_to_client, payload)


def decode_to_worker(payload: bytes) -> ToWorker:
    """The scheduler's frame to a worker process's command port (worker_commands.py)."""
    return _decode(_to_worker, payload)


def decode_reserved(payload: bytes) -> Reserved:
    """A worker process's answer to a `Reserve`."""
    return _decode(_reserved, payload)


def decode_as(kind: type, payload: bytes):
    """A message of one of the tensor-parallel group's types (tp_messages.py)."""
    return _decode(_decoders[kind], payload)


def _decode(decoder: msgspec.msgpack.Decoder, payload: bytes):
    if len(payload) > MAX_MESSAGE_BYTES:
        raise ProtocolError(f"message of {len(payload)} bytes is over the {MAX_MESSAGE_BYTES}-byte limit")
    try:
        return decoder.decode(payload)
    except (msgspec.DecodeError, msgspec.ValidationError, ValueError, TypeError) as exc:
        raise ProtocolError(str(exc)) from None
