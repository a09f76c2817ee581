"""The load policy of the autoscaler, without a cluster: grow on a high signal, shrink only when every
signal is low, one worker per decision, within each pool's bounds and the total budget."""

from __future__ import annotations

import pytest

from cluster.control.autoscale.load_policy import Bounds, decide
from cluster.control.scheduler.pool_load import PoolLoad, merged
from cluster.control.config import LoadThresholds

T = LoadThresholds()  # the shipped thresholds: queue 2 s / 0.25 s per worker, KV 0.8 / 0.3
WIDE = {"prefill": Bounds(1, 8), "decode": Bounds(1, 8), "colocated": Bounds(1, 8)}


def prefill(workers: int, queue_s_per_worker: float) -> PoolLoad:
    return PoolLoad("prefill", workers, queue_s_per_worker * workers, 0, 0, 0)


def decode(workers: int, kv_used: float, waiting: int = 0) -> PoolLoad:
    return PoolLoad("decode", workers, 0.0, int(kv_used * 1000 * workers), 1000 * workers, waiting)


def test_a_long_prefill_queue_grows_the_prefill_pool_by_one():
    d = decide({"prefill": prefill(2, 3.0), "decode": decode(1, 0.5)}, {"prefill": 2, "decode": 1}, WIDE, T, None)
    assert d.replicas == {"prefill": 3}
    assert d.reasons["prefill"].startswith("grow") and d.reasons["decode"].startswith("hold (between")


def test_between_the_thresholds_nothing_moves():
    d = decide({"prefill": prefill(2, 1.0), "decode": decode(2, 0.5)}, {"prefill": 2, "decode": 2}, WIDE, T, None)
    assert d.replicas == {}


def test_idle_pools_shrink_by_one_down_to_their_least():
    loads = {"prefill": prefill(3, 0.0), "decode": decode(1, 0.1)}
    d = decide(loads, {"prefill": 3, "decode": 1}, WIDE, T, None)
    assert d.replicas == {"prefill": 2}  # decode is at its least already
    assert "at its bound" in d.reasons["decode"]


@pytest.mark.parametrize("load", [decode(2, 0.9), decode(2, 0.1, waiting=3)], ids=["kv_high", "waiting"])
def test_committed_kv_or_any_waiting_request_grows_the_decode_pool(load):
    d = decide({"prefill": prefill(1, 1.0), "decode": load}, {"prefill": 1, "decode": 2}, WIDE, T, None)
    assert d.replicas == {"decode": 3}


def test_a_pool_at_its_most_holds():
    bounds = {"prefill": Bounds(1, 2), "decode": Bounds(1, 8)}
    d = decide({"prefill": prefill(2, 9.0), "decode": decode(1, 0.5)}, {"prefill": 2, "decode": 1}, bounds, T, None)
    assert d.replicas == {} and "at its bound" in d.reasons["prefill"]


def test_the_budget_goes_to_the_pool_under_most_pressure_after_shrinks():
    loads = {"prefill": prefill(2, 2.5), "decode": decode(2, 0.1, waiting=1)}
    d = decide(loads, {"prefill": 2, "decode": 2}, WIDE, T, max_workers=5)
    assert d.replicas == {"decode": 3}  # waiting requests: the most pressure
    assert "max_workers" in d.reasons["prefill"]
    # One pool idle, the other short: the idle one's worker pays for the other's.
    loads = {"prefill": prefill(3, 0.0), "decode": decode(2, 0.95)}
    d = decide(loads, {"prefill": 3, "decode": 2}, WIDE, T, max_workers=5)
    assert d.replicas == {"prefill": 2, "decode": 3}


def test_a_colocated_pool_shrinks_only_when_queue_and_kv_are_both_low():
    busy_kv = PoolLoad("colocated", 2, 0.0, 1000, 2000, 0)
    d = decide({"colocated": busy_kv}, {"colocated": 2}, WIDE, T, None)
    assert d.replicas == {}
    idle = PoolLoad("colocated", 2, 0.1, 100, 2000, 0)
    assert decide({"colocated": idle}, {"colocated": 2}, WIDE, T, None).replicas == {"colocated": 1}
    queued = PoolLoad("colocated", 2, 5.0, 100, 2000, 0)
    assert decide({"colocated": queued}, {"colocated": 2}, WIDE, T, None).replicas == {"colocated": 3}


def test_shards_add_up():
    a = (prefill(1, 1.0), decode(1, 0.5, waiting=1))
    b = (prefill(1, 3.0), decode(1, 0.1))
    total = merged([a, b])
    assert total["prefill"].workers == 2 and total["prefill"].queue_s_per_worker == pytest.approx(2.0)
    assert total["decode"].kv_used == pytest.approx(0.3) and total["decode"].waiting == 1


def test_thresholds_must_leave_a_band():
    with pytest.raises(ValueError, match="below its"):
        LoadThresholds(kv_low=0.9, kv_high=0.8)
