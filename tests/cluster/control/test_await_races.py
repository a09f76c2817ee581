"""Regression: the scheduler re-reads its state after every await.

Placing a request awaits the decode worker's `reserve`; before the registry and placement were
separate owners, the code after that await read the prefill worker's entry by id, and a worker
forgotten meanwhile reached the client as `RayTaskError(KeyError('prefill-0'))`. Here the reserve is
slowed by a fault hook and the prefill worker dies during it: the placement must be dropped (its
reservation aborted) and the request placed again, on what is left, with the engine's greedy output.
"""

from __future__ import annotations

import threading
import time

import pytest
import ray

from actors.engine.engine import Engine
from actors.protocol.sampling_params import SamplingParams
from cluster.control.launch import Cluster
from tests.helpers.cluster import load, wait_until_idle

pytestmark = pytest.mark.slow  # workers lost during slowed calls

RESERVE_DELAY_S = 5.0


def test_prefill_worker_lost_during_a_slow_reserve(ray_session):
    config = load("local.yaml")
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompt = list(range(40, 90))
    (expected,) = Engine(config.engine_config()).generate([prompt], params)
    cluster = Cluster.start(config)
    try:
        client = cluster.client()
        ray.get(cluster.workers["decode-0"].inject_fault.remote("slow_reserve", RESERVE_DELAY_S), timeout=30)
        outcome: dict = {}

        def run():
            try:
                outcome["result"] = client.generate([prompt], params, timeout_s=120)[0][0]
            except Exception as exc:  # noqa: BLE001 (the regression surfaced as RayTaskError(KeyError))
                outcome["error"] = exc

        submitter = threading.Thread(target=run)
        started = time.monotonic()
        submitter.start()
        time.sleep(0.5)  # the placement is now awaiting the slow reserve
        victim = cluster.workers.pop("prefill-0")
        ray.kill(victim, no_restart=True)
        while "prefill-0" in ray.get(cluster.scheduler.state.remote(), timeout=10).workers:
            time.sleep(0.05)
        assert time.monotonic() - started < RESERVE_DELAY_S, "precondition: the loss was seen after the reserve"
        ray.get(cluster.workers["decode-0"].inject_fault.remote(None), timeout=30)
        submitter.join(timeout=120)

        assert "error" not in outcome, outcome.get("error")
        assert outcome["result"].token_ids == expected.outputs[0].token_ids
        state = wait_until_idle(cluster)
        assert state["scheduler"]["in_flight"] == 0
        decode = state["workers"]["decode-0"]
        assert decode["reserved"] == decode["used_blocks"] == decode["live_requests"] == 0, decode
        assert state["scheduler"]["counters"]["local_prefills"] == 1  # no prefill worker left: run on decode
    finally:
        cluster.shutdown()
