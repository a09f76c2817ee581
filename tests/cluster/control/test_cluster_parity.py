"""Acceptance 1 and 3 of the cluster issue: the same greedy tokens through every layout, and nothing
left behind afterwards (no reservation, no lease, no used block)."""

from __future__ import annotations

import time

import pytest
import ray

from cluster.control.lifecycle.launch import Cluster
from cluster.frontend.open_client import open_client
from tests.helpers.cluster import load, wait_until_idle, workload


# The fast tier keeps one cluster per layout (1P+1D over zmq and over the collective, colocated).
SLOW = pytest.mark.slow


@pytest.mark.parametrize("config_name", ["local.yaml", pytest.param("disagg-2p2d.yaml", marks=SLOW), "colocated.yaml",
                                         "local.yaml+collective", pytest.param("disagg-2p2d.yaml+2shards", marks=SLOW),
                                         pytest.param("local.yaml+overlap", marks=SLOW)])
def test_layouts_match_the_single_engine(ray_session, expected, config_name):
    prompts, params = workload()
    cluster = Cluster.start(load(config_name))
    try:
        client = open_client(cluster)
        first = client.generate(prompts, params)
        second = client.generate(prompts, params)  # now with prefix-cache hits everywhere
        assert [r[0].token_ids for r in first] == expected
        assert [r[0].token_ids for r in second] == expected
        assert all(r[0].finish_reason == "length" for r in second)
        state = wait_until_idle(cluster)
        for stats in state["workers"].values():
            assert stats["reserved"] == 0 and stats["held"] == 0, stats
            assert stats["used_blocks"] == 0, stats
            assert stats["leases_expired"] == 0 and stats["transfers_failed"] == 0, stats
        assert state["scheduler"]["in_flight"] == 0
        if not config_name.startswith("colocated"):
            sent = sum(s["transfers_sent"] for s in state["workers"].values())
            adopted = sum(s["adopted"] for s in state["workers"].values())
            assert sent == adopted > 0
            # Every handoff is a sample of its link's cost at the scheduler (with the report after it).
            links, deadline = state["scheduler"]["links"], time.monotonic() + 30
            while sum(link["samples"] for link in links.values()) != adopted:
                assert time.monotonic() < deadline, (adopted, links)
                time.sleep(0.02)
                links = cluster.check_integrity()["scheduler"]["links"]
            assert all(name.split("->")[0].startswith("prefill-") for name in links), links
    finally:
        cluster.shutdown()


@SLOW
def test_scheduler_shards_each_serve_their_share_and_a_restarted_worker_rejoins_its_own(ray_session, expected):
    """Two scheduler shards over 2P+2D: each has one worker of each pool and admits the requests whose
    prompts hash to it; a decode worker that Ray restarts registers with its own shard again."""
    prompts, params = workload()
    cluster = Cluster.start(load("disagg-2p2d.yaml+2shards"))
    try:
        client = open_client(cluster)
        assert [r[0].token_ids for r in client.generate(prompts, params)] == expected
        states = [ray.get(s.state.remote(), timeout=30) for s in cluster.schedulers]
        assert [sorted(s.workers) for s in states] == [["decode-0", "prefill-0"], ["decode-1", "prefill-1"]]
        assert all(s.counters.submitted > 0 for s in states), [s.counters for s in states]
        before = states[1].incarnations["decode-1"]
        ray.kill(cluster.workers["decode-1"], no_restart=False)
        deadline = time.monotonic() + 120
        while ray.get(cluster.schedulers[1].state.remote(), timeout=30).incarnations.get("decode-1") in (None, before):
            assert time.monotonic() < deadline, "the restarted decode worker never registered with its shard"
            time.sleep(0.2)
        assert "decode-1" not in ray.get(cluster.schedulers[0].state.remote(), timeout=30).workers
        assert [r[0].token_ids for r in client.generate(prompts, params)] == expected
        state = wait_until_idle(cluster)
        assert state["scheduler"]["in_flight"] == 0
    finally:
        cluster.shutdown()
