"""Structured-output grammars compile off the workers' engine threads: while one request's grammar
compiles (held by the slow_grammar chaos hook until the test lets it go), the same prefill worker answers,
steps other requests to their end and keeps reporting; the held request then finishes under its grammar,
and one aborted while compiling leaves nothing behind and is never computed. Specs past the size limits
are refused before any compile."""

from __future__ import annotations

import json
import time

import pytest
import ray

from actors.engine.structured import GrammarError, Grammars
from actors.engine.text.tokenizer import load_tokenizer
from actors.protocol.sampling_params import SamplingParams
from actors.protocol.structured_output import MAX_ALTERNATIVES, MAX_DEPTH, MAX_SPEC_BYTES, StructuredOutput
from cluster.control.lifecycle.launch import Cluster
from cluster.frontend.open_client import open_client
from tests.helpers.cluster import load, wait_until_idle

PLAIN = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
JSON = SamplingParams(temperature=0.0, max_tokens=24, structured_output=StructuredOutput("json_object"))
# A grammar of its own for the abort test: one compiled before (and cached) would never wait on the desk.
CHOICE = SamplingParams(temperature=0.0, max_tokens=8,
                        structured_output=StructuredOutput("choice", json.dumps(["yes", "no", "maybe"])))
HOLD_MAX_S = 120.0  # the held compile's own bound; the tests let it go long before
WAIT_S = 60.0


@pytest.fixture(scope="module")
def cluster(ray_session):
    config = load("local.yaml")  # every prompt on the prefill worker (no local prefill on the decode worker)
    cluster = Cluster.start(config.model_copy(update={"scheduler": config.scheduler.model_copy(
        update={"local_prefill": False})}))
    yield cluster
    cluster.shutdown()


def _stats(cluster: Cluster, worker_id: str):
    """The worker's stats, answered by its engine thread (its inbox, in order)."""
    return ray.get(cluster.workers[worker_id].check_integrity.remote(), timeout=30)


def _wait_until_compiling(cluster: Cluster, prompt: list[int]) -> None:
    """Until the prefill worker's engine thread has taken the request (the stats come through the same inbox,
    after its submit) and left it to the grammar desk: its prompt queued there, nothing in the engine."""
    deadline = time.monotonic() + WAIT_S
    while True:
        stats = _stats(cluster, "prefill-0")
        if stats.queued_prefill_tokens == len(prompt) and stats.live_requests == stats.running == stats.waiting == 0:
            return
        assert time.monotonic() < deadline, f"the request never waited for its compile: {stats}"
        time.sleep(0.05)


def _steps(cluster: Cluster, worker_id: str) -> int:
    return ray.get(cluster.workers[worker_id].step_log.remote(0), timeout=30)[0]


def _submit_with_its_compile_held(cluster: Cluster, prompt: list[int], params: SamplingParams):
    """The client, and its request waiting on prefill-0 for a grammar compile held until the fault clears."""
    ray.get(cluster.workers["prefill-0"].inject_fault.remote("slow_grammar", HOLD_MAX_S), timeout=10)
    client = open_client(cluster)
    submitted = client.submit(prompt, params)
    assert submitted.route.prefill == "prefill-0" and not submitted.route.local, submitted.route
    _wait_until_compiling(cluster, prompt)
    return client, submitted


def test_a_held_compile_does_not_stop_the_worker(cluster):
    prompt = [5, 6, 7, 8]
    client, constrained = _submit_with_its_compile_held(cluster, prompt, JSON)
    lost_before = ray.get(cluster.scheduler.state.remote(), timeout=10).counters.workers_lost
    steps_before = _steps(cluster, "prefill-0")
    for i in range(3):  # on the same prefill worker, one after another, while the grammar compiles
        plain = client.submit([20 + i, 21, 22, 23, 24], PLAIN)
        assert plain.route.prefill == "prefill-0" and not plain.route.local, plain.route
        for _ in client.events(plain, timeout_s=WAIT_S):
            pass
        (result,) = plain.stream.results
        assert result.finish_reason == "length", result.error
    # Served meanwhile, not after it: the compile is still held (its prompt still waits on the desk), and
    # the worker's engine stepped the three prompts.
    _wait_until_compiling(cluster, prompt)
    assert _steps(cluster, "prefill-0") >= steps_before + 3
    assert not constrained.stream.finished, "the constrained request ended before its grammar compiled"
    state = ray.get(cluster.scheduler.state.remote(), timeout=10)
    assert "prefill-0" in state.workers and state.counters.workers_lost == lost_before  # it kept reporting
    ray.get(cluster.workers["prefill-0"].inject_fault.remote(None), timeout=10)  # the compile ends now
    for _ in client.events(constrained, timeout_s=WAIT_S):
        pass
    (answer,) = constrained.stream.results
    assert answer.finish_reason in ("stop", "length"), answer.error
    assert answer.token_ids
    wait_until_idle(cluster)


def test_a_request_aborted_while_its_grammar_compiles_leaves_nothing(cluster):
    prompt = [9, 10, 11, 12]
    client, submitted = _submit_with_its_compile_held(cluster, prompt, CHOICE)
    cancelled = ray.get(cluster.scheduler.state.remote(), timeout=10).counters.cancelled
    client.abort(submitted.request_id)
    # The abort reaches the worker (its engine thread drops the waiting request: nothing queued there now).
    deadline = time.monotonic() + WAIT_S
    while _stats(cluster, "prefill-0").queued_prefill_tokens:
        assert time.monotonic() < deadline, "the abort never reached the waiting request"
        time.sleep(0.05)
    steps_before = _steps(cluster, "prefill-0")
    ray.get(cluster.workers["prefill-0"].inject_fault.remote(None), timeout=10)  # the compile ends after the abort
    # A second request of the same grammar, on the same worker: its compile (or the cached grammar) comes
    # after the first compile's end on the desk's one thread, so once it has finished the aborted request's
    # compile has ended too, and it must not have started then.
    after = [13, 14, 15, 16, 17, 18]
    (second,) = client.generate([after], CHOICE, timeout_s=WAIT_S)[0]
    assert second.finish_reason in ("stop", "length"), second.error
    state = wait_until_idle(cluster)
    for stats in state["workers"].values():
        assert stats["live_requests"] == stats["queued_prefill_tokens"] == stats["used_blocks"] == 0, stats
    assert state["scheduler"]["counters"]["cancelled"] == cancelled + 1
    _, steps = ray.get(cluster.workers["prefill-0"].step_log.remote(steps_before), timeout=30)
    assert sum(s.prefill_tokens for s in steps) == len(after), steps  # the aborted prompt was never computed


def test_specs_past_the_limits_are_refused_before_compiling(default_model_dir):
    grammars = Grammars(load_tokenizer(default_model_dir), 49152)
    too_big = [
        StructuredOutput("choice", json.dumps([f"option {i}" for i in range(50_000)])),
        StructuredOutput("json_schema", json.dumps({"enum": [f"v{i}" for i in range(MAX_ALTERNATIVES + 1)]})),
        StructuredOutput("json_schema", "[" * (MAX_DEPTH + 5) + "]" * (MAX_DEPTH + 5)),
        StructuredOutput("regex", "a" * (MAX_SPEC_BYTES + 1)),
    ]
    for spec in too_big:
        with pytest.raises(GrammarError, match="at most"):
            grammars.compile(spec)
        assert grammars.compiles_begun == 0, spec.kind  # refused, not compiled (how fast: bench structured)
        assert not grammars.ready(spec)
    fine = StructuredOutput("choice", json.dumps([f"option {i}" for i in range(1000)]))
    assert fine.size_problem() is None
    grammars.compile(fine)
    assert grammars.ready(fine) and grammars.compiles_begun == 1
