"""A request is moved at most `MAX_MOVES` times (the README: 16): the cap the README states, read from where
it is defined (cluster/frontend/request_stream.py), with every bound as shipped.

Fast: the client's record of a request fed the failures a lost worker sends, one after each token. Slow (a
real cluster, 17 worker restarts, ~2.5 min here): its decode worker dies under the request every time it
lands there. A moved request runs whole on a decode worker (it recomputes the tokens already sent), so with one decode
worker every attempt after the first is there. The test kills that worker (Ray restarts it) as soon as each
attempt has sent a token: each death is a retryable failure and the client moves the request, continuing
from the tokens it has, until the cap; the death after the last allowed move ends the stream with a clean
error instead of a 17th move. Every token sent is the engine's, in order: no move lost or repeated one."""

from __future__ import annotations

import pytest
import ray

from actors.engine.engine import Engine
from actors.protocol.ids import AttemptId
from actors.protocol.messages import GenerateRequest, TokenDelta, WorkerRequest
from actors.protocol.request_status import RequestStatus
from actors.protocol.sampling_params import SamplingParams
from cluster.control.lifecycle.launch import Cluster
from cluster.frontend.open_client import open_client
from cluster.frontend.request_stream import MAX_MOVES, RequestStream
from tests.helpers.cluster import load, wait_restarted, wait_until_idle

# More tokens than the attempts can send before each is killed: only the deaths end it.
GREEDY = SamplingParams(temperature=0.0, max_tokens=1500, ignore_eos=True)


def test_the_failure_after_the_last_allowed_move_ends_the_stream():
    request = GenerateRequest("r", (1, 2, 3), SamplingParams(max_tokens=100), "tcp://sink")
    stream = RequestStream(request)
    for attempt_no in range(MAX_MOVES + 1):
        attempt = AttemptId("r", f"e:{attempt_no}")
        token = TokenDelta(attempt, 0, attempt_no, (10 + attempt_no,), RequestStatus.DECODING, 3)
        assert [ev.token_ids for ev in stream.feed(token)] == [(10 + attempt_no,)]
        events = stream.feed(TokenDelta.failure(WorkerRequest(attempt, request), "worker decode-0 was lost", True))
        if attempt_no < MAX_MOVES:
            assert events == [] and stream.migration_pending and stream.moves == attempt_no + 1
            assert stream.migration_request().output_prefix == tuple(range(10, 11 + attempt_no))
    (last,) = events
    assert last.finished and last.finish_reason == "error" and last.error == "worker decode-0 was lost"
    assert stream.moves == MAX_MOVES and not stream.migration_pending and stream.finished


@pytest.mark.slow
def test_the_death_after_the_last_allowed_move_ends_the_stream_with_an_error(ray_session):
    config = load("local.yaml")
    prompt = list(range(600, 640))
    (expected,) = Engine(config.engine_config()).generate([prompt], GREEDY)
    cluster = Cluster.start(config)
    try:
        client = open_client(cluster)
        handle = client.submit(prompt, GREEDY)
        stream, events, kills = handle.stream, [], 0
        for event in client.events(handle, timeout_s=600):
            events.append(event)
            # A token of the attempt the last death moved the request to (tokens the killed attempt had
            # already sent can still arrive before its failure does): this attempt dies too.
            if event.token_ids and not event.finished and stream.moves == kills:
                ray.kill(cluster.workers["decode-0"], no_restart=False)
                kills += 1
        tokens = [t for ev in events for t in ev.token_ids]
        last = events[-1]
        assert last.finished and last.finish_reason == "error", last
        assert "was lost" in last.error, last.error  # the worker's death, not the progress bound or the deadline
        assert kills == MAX_MOVES + 1 and stream.moves == MAX_MOVES, (kills, stream.moves, stream.stalls)
        assert stream.stalls == 0 and not stream.timed_out
        assert 0 < len(tokens) < GREEDY.max_tokens and tokens == expected.outputs[0].token_ids[:len(tokens)]
        wait_restarted(cluster, "decode-0")  # the last death's restart, registered (not the dead process)
        wait_until_idle(cluster)
    finally:
        cluster.shutdown()
