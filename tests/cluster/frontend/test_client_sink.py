"""The client's token sink survives garbage: a malformed message is dropped and counted, and the
deltas after it still reach their request."""

from __future__ import annotations

import queue

import zmq

from actors.protocol.codec import encode
from actors.protocol.ids import AttemptId
from actors.protocol.messages import TokenDelta
from actors.protocol.request_status import RequestStatus
from actors.protocol.sampling_params import SamplingParams
from cluster.frontend.client import TandemClient


def test_garbage_on_the_sink_is_dropped_and_the_stream_goes_on():
    client = TandemClient(scheduler=None)
    push = zmq.Context.instance().socket(zmq.PUSH)
    push.connect(client.sink)
    try:
        request = client.request([5, 6, 7], SamplingParams(max_tokens=2))
        deltas: queue.Queue = queue.Queue()
        client._listen(request, deltas)
        good = TokenDelta(AttemptId(request.request_id, "a"), 0, 0, (9,), RequestStatus.DECODING)
        for message in (b"\xc1 not msgpack", encode([{"attempt": 3}]), b"\x00" * 100, encode([good])):
            push.send(message)
        assert deltas.get(timeout=10) == good
        assert client.malformed == 3
    finally:
        push.close(linger=0)
        client.close()
