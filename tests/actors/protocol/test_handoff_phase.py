"""The handoff's one state machine: the moves a worker's KV may make, and the engine's record refusing any
other (the engine, both workers' lease tables and a worker's announcement all read this one enum)."""

from __future__ import annotations

import pickle

import pytest

from actors.engine.requests import EngineRequest, RequestMap
from actors.protocol.handoff_phase import MOVES, HandoffPhase, check_move
from actors.protocol.messages import GenerateRequest, LiveRequest
from actors.protocol.sampling_params import SamplingParams


def test_only_the_handoffs_moves_are_legal():
    legal = {(a, b) for a, targets in MOVES.items() for b in targets}
    assert legal == {(HandoffPhase.RESERVED, HandoffPhase.RUNNING), (HandoffPhase.RUNNING, HandoffPhase.HELD)}
    for before in HandoffPhase:
        for after in HandoffPhase:
            if (before, after) in legal:
                check_move(before, after)
            else:
                with pytest.raises(RuntimeError, match=f"illegal handoff move {before.name} -> {after.name}"):
                    check_move(before, after)


def test_the_engines_record_refuses_an_illegal_move():
    requests = RequestMap()
    requests.add(EngineRequest("held", HandoffPhase.HELD))
    with pytest.raises(RuntimeError, match="HELD -> RUNNING"):
        requests.adopted("held", seq=None)  # pages landing for a request this worker handed off


def test_a_live_announcement_carries_its_phase_to_the_scheduler():
    """A worker's announcement to a restarted scheduler (through Ray: pickled) arrives with its phase."""
    assert [p.value for p in HandoffPhase] == ["running", "reserved", "held"]
    request = GenerateRequest("r", [1, 2, 3], SamplingParams(), "tcp://127.0.0.1:9")
    for phase in HandoffPhase:
        live = LiveRequest(phase, request)
        assert pickle.loads(pickle.dumps(live)) == live
