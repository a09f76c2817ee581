"""The scheduler's request table after a restart: what a worker's announcement of a request decides."""

from __future__ import annotations

from actors.protocol.ids import AttemptId
from actors.protocol.handoff_phase import HandoffPhase
from actors.protocol.messages import GenerateRequest, LiveRequest, WorkerRequest
from actors.protocol.sampling_params import SamplingParams
from cluster.control.scheduler.request_table import Adoption, RequestTable

ATTEMPT = AttemptId("r1", "a1")


def _live(phase: HandoffPhase = HandoffPhase.RUNNING) -> LiveRequest:
    request = GenerateRequest("r1", (1, 2, 3), SamplingParams(max_tokens=4), "tcp://127.0.0.1:9")
    return LiveRequest(phase, WorkerRequest(ATTEMPT, request))


def test_an_abort_that_came_first_stops_every_announcement_of_the_request():
    """A worker may announce a request twice (two registrations in flight, the second listing what the
    first's abort had not stopped yet), and a prefill and a decode worker may both announce it: each is
    told to abort, none adopts it, and it counts as cancelled once."""
    table = RequestTable()
    table.remember_abort("r1")
    assert table.adopt_live("prefill-0", "prefill", _live(), blocks=1) is Adoption.ABORT
    assert table.adopt_live("decode-0", "decode", _live(), blocks=1) is Adoption.ABORT
    assert table.adopt_live("decode-0", "decode", _live(), blocks=1) is Adoption.ABORT
    assert len(table) == 0 and table.cancelled == 1
    table.check_integrity({"prefill-0", "decode-0"})


def test_an_announced_request_without_an_abort_is_adopted_once():
    table = RequestTable()
    assert table.adopt_live("decode-0", "decode", _live(), blocks=1) is Adoption.KEEP
    assert table.adopt_live("decode-0", "decode", _live(), blocks=1) is Adoption.KEEP
    assert len(table) == 1 and table.committed("decode-0") == 1 and table.cancelled == 0
    table.check_integrity({"decode-0"})


def test_an_announcement_that_raced_the_requests_end_is_aborted_not_adopted():
    """A second registration listed the request before it ended (its finish report, or the client's
    abort, got here first): the table does not track it again, and the worker is told to drop it."""
    table = RequestTable()
    assert table.adopt_live("decode-0", "decode", _live(), blocks=1) is Adoption.KEEP
    assert table.reclaim(ATTEMPT, failed=False, cancelled=True) is not None
    assert table.adopt_live("decode-0", "decode", _live(), blocks=1) is Adoption.ABORT
    assert len(table) == 0 and table.committed("decode-0") == 0 and table.cancelled == 1
    table.check_integrity({"decode-0"})
