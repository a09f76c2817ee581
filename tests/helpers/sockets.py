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
