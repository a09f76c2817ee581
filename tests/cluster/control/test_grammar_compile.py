"""Structured-output grammars compile off the workers' engine threads: while one request's grammar
compiles (made slow by the slow_grammar chaos hook), the same prefill worker serves other requests and
keeps reporting, the compiled request then finishes under its grammar, and one aborted while compiling
leaves nothing behind. Specs past the size limits are refused before any compile."""

from __future__ import annotations

import json
import threading
import time

import pytest
import ray

from actors.engine.structured import GrammarError, Grammars
from actors.engine.text.tokenizer import load_tokenizer
from actors.protocol.sampling_params import SamplingParams
from actors.protocol.structured_output import MAX_ALTERNATIVES, MAX_DEPTH, MAX_SPEC_BYTES, StructuredOutput
from cluster.control.launch import Cluster
from tests.helpers.cluster import load, wait_until_idle

PLAIN = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
JSON = SamplingParams(temperature=0.0, max_tokens=24, structured_output=StructuredOutput("json_object"))
COMPILE_DELAY_S = 6.0


@pytest.fixture(scope="module")
def cluster(ray_session):
    cluster = Cluster.start(load("local.yaml"))
    yield cluster
    cluster.shutdown()


def test_a_slow_compile_does_not_stop_the_worker(cluster):
    ray.get(cluster.workers["prefill-0"].inject_fault.remote("slow_grammar", COMPILE_DELAY_S), timeout=10)
    client, out = cluster.client(), {}
    started = time.monotonic()
    constrained = threading.Thread(target=lambda: out.update(json=client.generate([[5, 6, 7, 8]], JSON)[0][0]))
    constrained.start()
    time.sleep(0.5)
    for i in range(3):  # on the same prefill worker, one after another, while the grammar compiles
        (plain,) = client.generate([[20 + i, 21, 22, 23, 24]], PLAIN)[0]
        assert plain.finish_reason == "length", plain.error
    plain_done_s = time.monotonic() - started
    assert constrained.is_alive(), "the constrained request ended before its grammar could have compiled"
    constrained.join(timeout=120)
    done_s = time.monotonic() - started
    answer = out["json"]
    assert answer.finish_reason in ("stop", "length"), answer.error
    assert answer.token_ids and done_s >= COMPILE_DELAY_S
    assert plain_done_s < COMPILE_DELAY_S  # served meanwhile, not after it
    state = ray.get(cluster.scheduler.state.remote(), timeout=10)
    assert "prefill-0" in state.workers  # it kept reporting: never declared lost
    wait_until_idle(cluster)


def test_a_request_aborted_while_its_grammar_compiles_leaves_nothing(cluster):
    ray.get(cluster.workers["prefill-0"].inject_fault.remote("slow_grammar", COMPILE_DELAY_S), timeout=10)
    client = cluster.client()
    submitted = client.submit([9, 10, 11, 12], JSON)
    time.sleep(1.0)
    client.abort(submitted.request_id)
    time.sleep(COMPILE_DELAY_S)  # the compile ends after the abort: the request must not start then
    state = wait_until_idle(cluster, timeout_s=30)
    for stats in state["workers"].values():
        assert stats["live_requests"] == stats["queued_prefill_tokens"] == stats["used_blocks"] == 0, stats
    assert state["scheduler"]["in_flight"] == 0


def test_specs_past_the_limits_are_refused_before_compiling(default_model_dir):
    grammars = Grammars(load_tokenizer(default_model_dir), 49152)
    too_big = [
        StructuredOutput("choice", json.dumps([f"option {i}" for i in range(50_000)])),
        StructuredOutput("json_schema", json.dumps({"enum": [f"v{i}" for i in range(MAX_ALTERNATIVES + 1)]})),
        StructuredOutput("json_schema", "[" * (MAX_DEPTH + 5) + "]" * (MAX_DEPTH + 5)),
        StructuredOutput("regex", "a" * (MAX_SPEC_BYTES + 1)),
    ]
    for spec in too_big:
        started = time.monotonic()
        with pytest.raises(GrammarError, match="at most"):
            grammars.compile(spec)
        assert time.monotonic() - started < 1.0  # refused, not compiled
        assert not grammars.ready(spec)
    fine = StructuredOutput("choice", json.dumps([f"option {i}" for i in range(1000)]))
    assert fine.size_problem() is None
    grammars.compile(fine)
    assert grammars.ready(fine)
