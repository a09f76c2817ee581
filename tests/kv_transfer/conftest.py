"""Fixtures of the kv_transfer tests: started zmq receivers whose callbacks land in a queue, a sender."""

from __future__ import annotations

import queue

import pytest

from kv_transfer.zmq_transport import ZmqKVReceiver, ZmqKVSender
from tests.kv_transfer import WAIT_S


class Receiver:
    """A started ZmqKVReceiver whose callbacks land in a queue: ("ok", header) or ("error", header, exc)."""

    def __init__(self, caches, transport="ipc", on_complete=None, admit=None, **kw):
        self.caches = caches
        self.events: queue.Queue = queue.Queue()
        self.rx = ZmqKVReceiver(caches, on_complete or (lambda h: self.events.put(("ok", h))),
                                lambda h, e: self.events.put(("error", h, e)), transport=transport, admit=admit, **kw)
        self.rx.start()

    def next_event(self):
        return self.events.get(timeout=WAIT_S)


@pytest.fixture
def make_receiver():
    made = []

    def make(caches, transport="ipc", **kw):
        made.append(Receiver(caches, transport, **kw))
        return made[-1]

    yield make
    for r in made:
        r.rx.close()


@pytest.fixture
def sender():
    s = ZmqKVSender()
    yield s
    s.close()
