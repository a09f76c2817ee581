"""Role flips: a live worker turns from prefill to decode and back under load, in the same process (no
weights reloaded), with every greedy answer exact and nothing left behind; a flipped worker that dies
comes back in its new role; flips the pools cannot allow are refused."""

from __future__ import annotations

import os
import threading
import time

import pytest
import ray

from actors.engine.engine import Engine
from actors.protocol.sampling_params import SamplingParams
from cluster.control.lifecycle.launch import Cluster
from cluster.control.lifecycle.role_flip import flip, flip_refusal
from cluster.control.lifecycle.scaling import scale
from cluster.frontend.open_client import open_client
from tests.helpers.cluster import ClosedLoop, load, wait_until_idle

PROMPTS = [list(range(20 + 9 * i, 60 + 13 * i)) for i in range(6)]
PARAMS = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def expected():
    engine = Engine(load("local.yaml").engine_config())
    return [r.outputs[0].token_ids for r in engine.generate(PROMPTS, PARAMS)]


@pytest.fixture(scope="module")
def cluster(ray_session):
    config = load("local.yaml")
    config = config.model_copy(update={"prefill": config.prefill.model_copy(update={"replicas": 2})})
    cluster = Cluster.start(config)
    yield cluster
    cluster.shutdown()


def pid(cluster: Cluster, worker_id: str) -> int:
    return ray.get(cluster.workers[worker_id].__ray_call__.remote(lambda _: os.getpid()), timeout=30)


def roles(cluster: Cluster) -> dict[str, str]:
    return {wid: view.role for wid, view in ray.get(cluster.scheduler.state.remote(), timeout=10).workers.items()}


def assert_clean(cluster: Cluster) -> None:
    state = wait_until_idle(cluster)
    for stats in state["workers"].values():
        assert stats["used_blocks"] == stats["reserved"] == stats["held"] == stats["live_requests"] == 0, stats
    assert state["scheduler"]["in_flight"] == 0
    assert set(state["scheduler"]["workers"]) == set(cluster.workers)


def test_a_worker_flips_to_decode_and_back_under_load(cluster, expected):
    before = pid(cluster, "prefill-1")
    traffic = ClosedLoop(cluster, PROMPTS, PARAMS, expected)
    try:
        traffic.wait_done(4)  # the flip comes under load
        result = scale(cluster, {"prefill": 1, "decode": 2}, flips=True)
        assert [(f["from"], f["to"], f["cold"]) for f in result["flipped"]] == [("prefill-1", "decode-1", False)]
        assert result["added"] == result["removed"] == []
        assert pid(cluster, "decode-1") == before  # the same process: its weights stayed loaded
        assert roles(cluster) == {"prefill-0": "prefill", "decode-0": "decode", "decode-1": "decode"}
        # The flipped worker takes decode work: enough fresh prompts spill onto it.
        client, deadline = open_client(cluster), time.monotonic() + 60
        while ray.get(cluster.scheduler.state.remote(), timeout=10).as_dict()["worker_stats"].get(
                "decode-1", {}).get("adopted", 0) == 0:
            assert time.monotonic() < deadline, "the flipped worker never adopted a handoff"
            results = client.generate(PROMPTS, PARAMS)
            assert [r[0].token_ids for r in results] == expected
        done = traffic.done
        back = scale(cluster, {"prefill": 2, "decode": 1}, flips=True)
        assert [(f["from"], f["to"]) for f in back["flipped"]] == [("decode-1", "prefill-2")]
        assert pid(cluster, "prefill-2") == before
        traffic.wait_done(done + 4)  # and it goes on after the flip back
    finally:
        traffic.stop()
    assert traffic.bad == [], traffic.bad[:3]
    assert traffic.done > done > 5
    assert sorted(cluster.workers) == ["decode-0", "prefill-0", "prefill-2"]
    assert cluster.config.prefill.replicas == 2 and cluster.config.decode.replicas == 1
    assert_clean(cluster)


def test_a_flipped_worker_that_dies_comes_back_in_its_new_role(cluster, expected):
    first = flip(cluster, "prefill-2", "decode")
    assert not first.cold and first.new_id in cluster.workers
    old_pid = pid(cluster, first.new_id)
    ray.kill(cluster.workers[first.new_id], no_restart=False)  # Ray restarts it with its creation spec
    deadline = time.monotonic() + 120
    while True:
        try:
            if pid(cluster, first.new_id) != old_pid and roles(cluster).get(first.new_id) == "decode":
                break
        except ray.exceptions.RayError:
            pass  # still restarting
        assert time.monotonic() < deadline, f"{first.new_id} did not come back as a decode worker"
        time.sleep(0.2)
    assert "prefill-2" not in roles(cluster)
    results = open_client(cluster).generate(PROMPTS, PARAMS)
    assert [r[0].token_ids for r in results] == expected
    again = flip(cluster, first.new_id, "prefill")
    assert not again.cold
    assert roles(cluster)[again.new_id] == "prefill"
    assert_clean(cluster)


def test_flips_the_pools_cannot_allow_are_refused(cluster):
    config = cluster.config
    assert flip_refusal(config, "prefill", "decode") is None
    assert "no colocated pool" in flip_refusal(config, "prefill", "colocated")
    assert "already" in flip_refusal(config, "decode", "decode")
    gpu = config.model_copy(update={"decode": config.decode.model_copy(update={"num_gpus": 1})})
    assert "different resources" in flip_refusal(gpu, "prefill", "decode")
    tp = config.model_copy(update={"decode": config.decode.model_copy(update={"tensor_parallel_size": 2})})
    assert "tensor-parallel" in flip_refusal(tp, "prefill", "decode")
    collective = config.model_copy(update={"transfer": config.transfer.model_copy(update={"backend": "collective"})})
    assert "collective" in flip_refusal(collective, "prefill", "decode")
    with pytest.raises(ValueError, match="cannot become"):
        flip(cluster, "decode-0", "decode")
    # A flip that would leave a pool below its minimum goes through `scale`, which refuses it.
    with pytest.raises(ValueError, match="decode replicas must be at least 1"):
        scale(cluster, {"decode": 0, "prefill": 3}, flips=True)


def test_a_worker_slower_to_drain_than_a_cold_start_stops_and_a_new_one_starts(cluster):
    """A flip waits for the worker's drain; a decode worker holding long answers frees later than a new
    worker starts, so the resize starts one cold instead (and the answers still finish where they are)."""
    quick = scale(cluster, {"prefill": 1, "decode": 2}, flips=True)  # an idle prefill worker drains at once
    assert len(quick["flipped"]) == 1 and quick["added"] == quick["removed"] == []
    victim = max((wid for wid in cluster.workers if wid.startswith("decode-")), key=lambda w: int(w.split("-")[1]))
    long = SamplingParams(temperature=0.0, max_tokens=600, ignore_eos=True)
    engine = Engine(load("local.yaml").engine_config())
    expected_long = [r.outputs[0].token_ids for r in engine.generate(PROMPTS, long)]
    traffic = ClosedLoop(cluster, PROMPTS, long, expected_long)
    try:
        deadline = time.monotonic() + 60
        while ray.get(cluster.scheduler.state.remote(), timeout=10).as_dict()["worker_stats"].get(
                victim, {}).get("live_requests", 0) == 0:
            assert time.monotonic() < deadline, f"{victim} never took a long answer"
            time.sleep(0.05)
        cluster.worker_start_s = 1e-6  # any answer still to finish drains slower than this
        result = scale(cluster, {"prefill": 2, "decode": 1}, flips=True)
    finally:
        traffic.stop()
    assert result["flipped"] == [] and result["removed"] == [victim] and len(result["added"]) == 1
    assert result["added"][0].startswith("prefill-") and cluster.worker_start_s > 1e-6  # measured again
    assert traffic.bad == [], traffic.bad[:3]
    assert_clean(cluster)


def test_a_resize_that_flips_and_starts_cold_serves_the_flip_before_the_new_worker_is_ready(cluster, expected):
    sizes = {role: pool.replicas for role, pool in cluster.config.pools().items()}
    if sizes["prefill"] < 2:
        scale(cluster, {"prefill": 2}, flips=True)
    leaving = max((w for w in cluster.workers if w.startswith("prefill-")), key=lambda w: int(w.split("-")[1]))
    process = pid(cluster, leaving)
    decoders = {w for w, role in roles(cluster).items() if role == "decode"}
    traffic = ClosedLoop(cluster, PROMPTS, PARAMS, expected)
    out = {}
    resize = threading.Thread(target=lambda: out.update(scale(
        cluster, {"prefill": 1, "decode": len(decoders) + 2}, flips=True)))
    try:
        resize.start()
        deadline = time.monotonic() + 120
        # The scheduler registers the flipped worker before the resize's thread adds it to `cluster.workers`.
        while not ((new := [w for w, role in roles(cluster).items() if role == "decode" and w not in decoders])
                   and all(w in cluster.workers for w in new)):
            assert time.monotonic() < deadline, "no new decode worker registered"
            time.sleep(0.02)
        assert len(new) == 1 and pid(cluster, new[0]) == process, new  # the flip, while the cold one still loads
        resize.join(timeout=300)
    finally:
        traffic.stop()
    assert not resize.is_alive()
    assert len(out["flipped"]) == 1 and len(out["added"]) == 1 and out["removed"] == [], out
    assert traffic.bad == [], traffic.bad[:3]
    assert_clean(cluster)
    scale(cluster, sizes, flips=True)
    assert_clean(cluster)
