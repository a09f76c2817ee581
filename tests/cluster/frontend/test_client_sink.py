"""The client's token sink: garbage is dropped and counted and the deltas after it still reach their
request; with the cluster's keys, nobody else can stream into it; a dead receiving thread shows."""

from __future__ import annotations

import queue

import pytest
import zmq

from actors.protocol.codec import encode
from actors.protocol.ids import AttemptId
from actors.protocol.messages import TokenDelta
from actors.protocol.request_status import RequestStatus
from actors.protocol.sampling_params import SamplingParams
from actors.protocol.token_stream import TokenPublisher
from cluster.frontend.client import TandemClient
from kv_transfer.curve import CurveKeys


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
        assert client.drops.snapshot() == {"malformed": 3}
        assert client.sink_alive
    finally:
        push.close(linger=0)
        client.close()


def test_only_the_cluster_can_stream_into_a_keyed_sink():
    """A forged delta (the wire id sniffed, say) from a peer without the cluster's secret never lands;
    a publisher holding the keys gets through."""
    keys = CurveKeys.generate()
    client = TandemClient(scheduler=None, keys=keys)
    request = client.request([5, 6, 7], SamplingParams(max_tokens=2))
    deltas: queue.Queue = queue.Queue()
    client._listen(request, deltas)
    attempt = AttemptId(request.request_id, "a")
    forged = TokenDelta(attempt, 0, 0, (66,), RequestStatus.FINISHED_STOPPED, error="attacker text")
    strangers = [TokenPublisher(), TokenPublisher(keys=CurveKeys.generate())]
    member = TokenPublisher(keys=keys)
    try:
        for publisher in strangers:
            publisher.publish(client.sink, [forged])
        good = TokenDelta(attempt, 0, 0, (9,), RequestStatus.DECODING)
        member.publish(client.sink, [good])
        assert deltas.get(timeout=10) == good
        with pytest.raises(queue.Empty):
            deltas.get(timeout=1.0)
        assert client.drops.snapshot() == {}
    finally:
        for publisher in [*strangers, member]:
            publisher.close()
        client.close()


def test_a_killed_sink_shows():
    client = TandemClient(scheduler=None)
    try:
        assert client.sink_alive
        client.kill_sink()
        assert not client.sink_alive
    finally:
        client.close()
