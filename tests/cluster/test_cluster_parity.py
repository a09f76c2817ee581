"""Acceptance 1 and 3 of the cluster issue: the same greedy tokens through every layout, and nothing
left behind afterwards (no reservation, no lease, no used block)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from actors.engine import Engine
from actors.sampling_params import SamplingParams
from cluster.config import TandemConfig
from cluster.launch import Cluster

CONFIGS = Path(__file__).parents[2] / "configs"


def load(name: str, **engine) -> TandemConfig:
    backend = "zmq"
    if name.endswith("+collective"):
        name, backend = name.removesuffix("+collective"), "collective"
    config = TandemConfig.from_file(CONFIGS / name)
    return config.model_copy(update={
        "engine": config.engine.model_copy(update={"num_kv_blocks": 512, **engine}),
        "transfer": config.transfer.model_copy(update={"backend": backend}),
    })


def workload(n: int = 32):
    g = torch.Generator().manual_seed(11)
    system = torch.randint(10, 2048, (40,), generator=g).tolist()  # a repeated system prompt: cache hits
    prompts, params = [], []
    for i in range(n):
        length = [3, 7, 15, 16, 17, 33, 64, 90][i % 8]  # shorter than, equal to and across blocks of 16
        own = torch.randint(10, 2048, (length,), generator=g).tolist()
        prompts.append(system + own if i % 3 == 0 else own)
        params.append(SamplingParams(temperature=0.0, max_tokens=4 + (i * 7) % 24, ignore_eos=True))
    return prompts, params


@pytest.fixture(scope="module")
def expected():
    prompts, params = workload()
    engine = Engine(load("local.yaml").engine_config())
    return [r.outputs[0].token_ids for r in engine.generate(prompts, params)]


def wait_until_idle(cluster: Cluster, timeout_s: float = 10.0) -> dict:
    """Integrity of every worker and the scheduler once the last reports are in."""
    deadline = time.monotonic() + timeout_s
    while True:
        state = cluster.check_integrity()
        workers = state["workers"].values()
        idle = state["scheduler"]["in_flight"] == 0 and all(
            w["reserved"] == 0 and w["held"] == 0 and w["live_requests"] == 0 and w["used_blocks"] == 0 for w in workers
        )
        if idle or time.monotonic() > deadline:
            return state
        time.sleep(0.05)


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
    finally:
        cluster.shutdown()
