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
from cluster.control.lifecycle.launch import Cluster
from cluster.frontend.open_client import open_client
from tests.helpers.cluster import load, wait_until_idle

pytestmark = pytest.mark.slow  # workers lost during slowed calls

RESERVE_DELAY_S = 8.0  # the window in which the test kills the prefill worker and the scheduler sees it
WAIT_S = 30.0


def wait_for(predicate, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def _queued_on(cluster: Cluster, worker_id: str) -> int | None:
    view = ray.get(cluster.scheduler.state.remote(), timeout=10).workers.get(worker_id)
    return None if view is None else view.queued_prefill_tokens


def test_prefill_worker_lost_during_a_slow_reserve(ray_session):
    config = load("local.yaml")
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompt = list(range(40, 90))
    (expected,) = Engine(config.engine_config()).generate([prompt], params)
    cluster = Cluster.start(config)
    try:
        client = open_client(cluster)
        ray.get(cluster.workers["decode-0"].inject_fault.remote("slow_reserve", RESERVE_DELAY_S), timeout=30)
        outcome: dict = {}

        def run():
            try:
                outcome["result"] = client.generate([prompt], params, timeout_s=120)[0][0]
            except Exception as exc:  # noqa: BLE001 (the regression surfaced as RayTaskError(KeyError))
                outcome["error"] = exc

        submitter = threading.Thread(target=run)
        before = ray.get(cluster.scheduler.state.remote(), timeout=10).counters
        submitter.start()
        # While the placement awaits the decode worker's reserve, it holds the prompt's tokens as queued on
        # the prefill worker it chose (registry.queued_meanwhile); nothing else is queued there.
        wait_for(lambda: _queued_on(cluster, "prefill-0") == len(prompt), "the placement to await the slow reserve")
        victim = cluster.workers.pop("prefill-0")
        ray.kill(victim, no_restart=True)
        wait_for(lambda: "prefill-0" not in ray.get(cluster.scheduler.state.remote(), timeout=10).workers,
                 "the scheduler to forget the killed prefill worker")
        ray.get(cluster.workers["decode-0"].inject_fault.remote(None), timeout=30)
        submitter.join(timeout=120)
        assert not submitter.is_alive(), "the request did not end within its own 120 s deadline"

        assert "error" not in outcome, outcome.get("error")
        assert outcome["result"].token_ids == expected.outputs[0].token_ids
        state = wait_until_idle(cluster)
        assert state["scheduler"]["in_flight"] == 0
        decode = state["workers"]["decode-0"]
        assert decode["reserved"] == decode["used_blocks"] == decode["live_requests"] == 0, decode
        counters = state["scheduler"]["counters"]
        assert counters["local_prefills"] == 1  # no prefill worker left: run on decode
        # The race was met: the loss came during the await, so the placement was dropped when it re-read
        # its state (never committed on the dead worker: that would have been re-routed after the loss).
        assert counters["rerouted"] == before.rerouted and counters["workers_lost"] == before.workers_lost + 1, counters
    finally:
        cluster.shutdown()
