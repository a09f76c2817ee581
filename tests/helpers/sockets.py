"""Hand-made zmq traffic for tests: what a stranger (or a buggy peer) could push at a socket."""

from __future__ import annotations

import zmq


def raw_push(endpoint: str, messages: list[list[bytes]], kind: int = zmq.PUSH) -> None:
    """Hand-made messages, in order, through one PUSH socket (or `kind`: a DEALER for a ROUTER); queued
    ones still leave for 2 s."""
    with zmq.Context.instance().socket(kind) as s:
        s.setsockopt(zmq.LINGER, 2000)
        s.connect(endpoint)
        for frames in messages:
            s.send_multipart(frames)


def stranger(endpoint: str, server_key: bytes, kind: int = zmq.PUSH) -> zmq.Socket:
    """A CURVE socket that knows the server's public key (public keys are no secret) but holds a key pair
    of its own, so the server's ZAP check refuses it."""
    from kv_transfer.curve import CurveKeys

    sock = zmq.Context.instance().socket(kind)
    own = CurveKeys.generate()
    sock.curve_serverkey, sock.curve_publickey, sock.curve_secretkey = server_key, own.public, own.secret
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDTIMEO, 2000)
    sock.connect(endpoint)
    return sock


def offer(sock: zmq.Socket, *frames: bytes) -> None:
    """Sends what a stranger would, while zmq still has somewhere to put it: once the server has refused
    the handshake zmq drops the connection's pipe, and a PUSH or DEALER send would then block forever
    (CI once hung here for its whole timeout)."""
    try:
        sock.send_multipart(frames)
    except zmq.Again:
        pass  # refused before anything was sent: the attack was stopped even earlier
