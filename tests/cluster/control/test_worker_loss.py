"""A worker lost mid-request: nothing hangs. A lost prefill is re-routed (the client sees only latency);
a lost decode's stream is migrated to the engine's exact output; restarted workers re-register and serve
again; after each, nothing is held anywhere."""

from __future__ import annotations

import time

import pytest
import ray

from actors.engine.engine import Engine
from actors.protocol.sampling_params import SamplingParams
from cluster.control.lifecycle.launch import Cluster
from cluster.frontend.open_client import open_client
from tests.helpers.cluster import load, wait_until_idle

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def cluster(ray_session):
    config = load("local.yaml")
    config = config.model_copy(update={"scheduler": config.scheduler.model_copy(
        update={"heartbeat_timeout_s": 2.0, "local_prefill": False})})
    cluster = Cluster.start(config)
    yield cluster
    cluster.shutdown()


def test_lost_prefill_worker_is_rerouted(cluster):
    """The prefill worker dies with the request on it (its step slowed so that it cannot hand off first):
    the scheduler places the request again, once, and the client gets the engine's output."""
    prompt = list(range(20, 60))
    (expected,) = Engine(load("local.yaml").engine_config()).generate([prompt], GREEDY)
    client, worker = open_client(cluster), cluster.workers["prefill-0"]
    ray.get(worker.inject_fault.remote("slow_step", 5.0), timeout=30)
    ray.get(worker.check_integrity.remote(), timeout=30)  # the fault is in place (same inbox, in order)
    before = ray.get(cluster.scheduler.state.remote(), timeout=10)
    submitted = client.submit(prompt, GREEDY)
    assert submitted.route.prefill == "prefill-0", submitted.route  # precondition: the request is on it
    ray.kill(worker, no_restart=False)  # dies inside the slowed prefill step; Ray restarts it
    start = time.monotonic()
    for _ in client.events(submitted, timeout_s=60):
        pass
    (result,) = submitted.stream.results
    assert result.finish_reason == "length", result.error
    assert result.token_ids == expected.outputs[0].token_ids
    assert time.monotonic() - start < 60
    cluster.wait_registered({"prefill-0", "decode-0"}, timeout_s=60)  # the restarted worker is back
    after = wait_until_idle(cluster)["scheduler"]
    assert after["incarnations"]["prefill-0"] != before.incarnations["prefill-0"]  # the restarted process
    # Found on the lost worker before any handoff (whether Ray's death notice or the restarted worker's
    # registration told the scheduler first), the request was placed again exactly once.
    assert after["counters"]["rerouted"] == before.counters.rerouted + 1, (before.counters, after["counters"])
    # Counted per attempt: the one on the lost worker failed, the request finished once.
    assert (after["counters"]["failed"], after["counters"]["finished"]) == (
        before.counters.failed + 1, before.counters.finished + 1), (before.counters, after["counters"])
    (again,) = client.generate([prompt[::-1]], GREEDY, timeout_s=60)[0]
    assert again.finish_reason == "length"
    wait_until_idle(cluster)


def test_lost_decode_worker_mid_stream_is_migrated(cluster):
    """The stream continues on a live decode worker with no token lost or duplicated."""
    prompt = list(range(30, 50))
    long = SamplingParams(temperature=0.0, max_tokens=300, ignore_eos=True)
    (expected,) = Engine(load("local.yaml").engine_config()).generate([prompt], long)
    client = open_client(cluster)
    before = ray.get(cluster.scheduler.state.remote(), timeout=10)
    submitted = client.submit(prompt, long)
    stream = client.events(submitted, timeout_s=120)
    events = [next(stream) for _ in range(3)]
    ray.kill(cluster.workers["decode-0"], no_restart=False)  # Ray restarts it; it re-registers
    events += list(stream)
    assert events[-1].finished and events[-1].finish_reason == "length", events[-1]
    tokens = [t for ev in events for t in ev.token_ids]
    assert tokens == expected.outputs[0].token_ids
    # The kill met the stream: the client moved it, and each attempt it gave up ended failed in the
    # scheduler (none leaked, none counted finished); the one that ran to the end is the only finish.
    moves = submitted.stream.moves
    assert moves >= 1, "the stream was never migrated: the worker died after it ended"
    cluster.wait_registered({"prefill-0", "decode-0"}, timeout_s=60)
    after = wait_until_idle(cluster)["scheduler"]  # (the last finish report comes after the last token)
    assert after["incarnations"]["decode-0"] != before.incarnations["decode-0"]  # the restarted process
    counted = after["counters"]
    assert counted["failed"] - before.counters.failed == moves, (moves, before.counters, counted)
    assert counted["finished"] == before.counters.finished + 1, (before.counters, counted)


def test_an_attempt_that_never_reaches_its_worker_is_placed_again(cluster):
    """The prefill worker is alive and reporting but one submit never arrives (seen after a worker
    restart under load: the stream waited until its client gave up). Its reports never name the
    attempt, so after a heartbeat timeout the scheduler places it again: the engine's output, no hang."""
    prompt = list(range(900, 940))
    (expected,) = Engine(load("local.yaml").engine_config()).generate([prompt], GREEDY)
    worker = cluster.workers["prefill-0"]
    ray.get(worker.inject_fault.remote("drop_next_submit"), timeout=30)
    ray.get(worker.check_integrity.remote(), timeout=30)  # the fault is in place (same inbox, in order)
    before = ray.get(cluster.scheduler.state.remote(), timeout=10).counters
    (result,) = open_client(cluster).generate([prompt], GREEDY, timeout_s=60)[0]
    assert result.token_ids == expected.outputs[0].token_ids and result.finish_reason == "length"
    after = ray.get(cluster.scheduler.state.remote(), timeout=10).counters
    assert after.lost_submits == before.lost_submits + 1, after
    wait_until_idle(cluster)


@pytest.mark.parametrize("worker_id", ["prefill-0", "decode-0"])
def test_a_step_longer_than_the_heartbeat_timeout_is_not_a_death(cluster, worker_id):
    """A step that takes 2.5x the heartbeat timeout (a long prefill on a slow CPU: ~9 s for 2048 tokens of
    SmolLM2 on one core here) is work, not silence: the worker's pulse keeps it alive, nothing is routed
    around it, and the request ends with the engine's output. (Before the pulse, reports waited for the
    step's end and the worker was declared dead.)"""
    prompt = list(range(700, 740))
    (expected,) = Engine(load("local.yaml").engine_config()).generate([prompt], GREEDY)
    cluster.wait_registered(set(cluster.workers), timeout_s=60)  # back from the tests before: a loss now is ours
    wait_until_idle(cluster)
    worker = cluster.workers[worker_id]
    ray.get(worker.inject_fault.remote("slow_step", 5.0), timeout=30)
    before = ray.get(cluster.scheduler.state.remote(), timeout=10).counters
    (result,) = open_client(cluster).generate([prompt], GREEDY, timeout_s=60)[0]
    assert result.token_ids == expected.outputs[0].token_ids and result.finish_reason == "length"
    after = ray.get(cluster.scheduler.state.remote(), timeout=10).counters
    assert (after.workers_lost, after.rerouted, after.lost_submits) == (
        before.workers_lost, before.rerouted, before.lost_submits), after
    wait_until_idle(cluster)

