"""Acceptance 1 and 3 of the cluster issue: the same greedy tokens through every layout, and nothing
left behind afterwards (no reservation, no lease, no used block)."""

from __future__ import annotations

import time

import pytest

from cluster.control.launch import Cluster
from tests.helpers.cluster import load, wait_until_idle, workload


@pytest.mark.parametrize("config_name", ["local.yaml", "disagg-2p2d.yaml", "colocated.yaml", "local.yaml+collective"])
def test_layouts_match_the_single_engine(ray_session, expected, config_name):
    prompts, params = workload()
    cluster = Cluster.start(load(config_name))
    try:
        client = cluster.client()
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
            links = state["scheduler"]["links"]
            for _ in range(100):
                if sum(link["samples"] for link in links.values()) == adopted:
                    break
                time.sleep(0.02)
                links = cluster.check_integrity()["scheduler"]["links"]
            assert sum(link["samples"] for link in links.values()) == adopted, links
            assert all(name.split("->")[0].startswith("prefill-") for name in links), links
    finally:
        cluster.shutdown()
