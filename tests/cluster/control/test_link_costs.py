"""The scheduler's handoff cost per link: fitted from the decode workers' samples, and what it does to
routing (a slow link sends the prefill to the decode worker itself)."""

from __future__ import annotations

import math

import pytest

from actors.protocol.messages import TransferSample
from cluster.control.scheduler.link_costs import LinkCosts
from cluster.control.scheduler.routing import WorkerView, plan_prefill

MB = 1 << 20


def samples(prefill: str, latency_s: float, bytes_per_s: float, sizes: list[int]) -> tuple[TransferSample, ...]:
    return tuple(TransferSample(prefill, n, latency_s + n / bytes_per_s) for n in sizes)


def test_an_unmeasured_link_costs_the_configured_bandwidth():
    links = LinkCosts(default_bytes_per_s=1e9)
    assert links.seconds("p0", "d0", 2 * 10**9) == pytest.approx(2.0)
    assert links.estimates() == {}


def test_the_fit_separates_latency_from_bandwidth():
    links = LinkCosts(1e9)
    links.observe("d0", samples("p0", 0.02, 10 * MB, [MB, 4 * MB, 2 * MB, 8 * MB] * 5))
    assert links.seconds("p0", "d0", 16 * MB) == pytest.approx(0.02 + 1.6, rel=1e-6)
    est = links.estimates()["p0->d0"]
    assert est.latency_s == pytest.approx(0.02, rel=1e-6) and est.bytes_per_s == pytest.approx(10 * MB, rel=1e-6)
    assert est.samples == 20
    # A link not measured yet costs what its measured peers into the same decode worker cost.
    assert links.seconds("p1", "d0", 16 * MB) == pytest.approx(0.02 + 1.6, rel=1e-6)
    links.observe("d0", samples("p1", 0.0, 40 * MB, [MB, 4 * MB] * 5))
    assert links.seconds("p2", "d0", 16 * MB) == pytest.approx((1.62 + 0.4) / 2, rel=1e-6)
    assert links.seconds("p2", "d1", 16 * MB) == pytest.approx((1.62 + 0.4) / 2, rel=1e-6)  # no peer into d1
    links.check_integrity()


def test_one_handoff_size_gives_the_mean_seconds_per_byte():
    links = LinkCosts(1e9)
    links.observe("d0", samples("p0", 0.0, 5 * MB, [3 * MB] * 4))
    assert links.seconds("p0", "d0", 6 * MB) == pytest.approx(1.2)


def test_a_link_that_slows_down_is_followed():
    links = LinkCosts(1e9)
    sizes = [MB, 3 * MB] * 20
    links.observe("d0", samples("p0", 0.001, 1000 * MB, sizes))
    assert links.seconds("p0", "d0", 10 * MB) < 0.05
    links.observe("d0", samples("p0", 0.001, 10 * MB, sizes[:12]))  # the link is shaped to 1%: a dozen handoffs
    assert links.seconds("p0", "d0", 10 * MB) == pytest.approx(1.0, rel=0.1)


def test_a_link_not_measured_for_a_while_is_tried_again():
    """Once the cost model prefills locally, nothing measures the slow link: after a while its fit is
    dropped, so one handoff measures it again (and a link that recovered is used again)."""
    links = LinkCosts(1e9)
    links.observe("d0", samples("p0", 0.0, MB, [MB, 2 * MB]), now=100.0)
    assert links.seconds("p0", "d0", MB, now=120.0) == pytest.approx(1.0)
    assert links.seconds("p0", "d0", MB, now=131.0) == pytest.approx(MB / 1e9)
    assert links.estimates() == {}


def test_garbage_samples_are_ignored_and_a_lost_worker_forgets_its_links():
    links = LinkCosts(1e9)
    links.observe("d0", (TransferSample("p0", 0, 1.0), TransferSample("p0", MB, math.nan),
                         TransferSample("p0", MB, -1.0), TransferSample("p0", -5, 1.0)))
    assert links.estimates() == {}
    links.observe("d0", samples("p0", 0.0, MB, [MB]))
    links.observe("d1", samples("p0", 0.0, MB, [MB]))
    links.forget("d0")
    assert list(links.estimates()) == ["p0->d1"]
    links.check_integrity()


def test_a_slow_link_makes_the_cost_model_prefill_on_the_decode_worker():
    cost = 1e-4  # s per prompt token, the same on every worker
    prefill = [WorkerView("p0", "prefill", 100, 100)]
    decode = WorkerView("d0", "decode", 100, 100)
    nbytes, prompt = 8 * MB, 512
    fast, slow = LinkCosts(1e9), LinkCosts(1e9)
    fast.observe("d0", samples("p0", 0.0005, 1000 * MB, [MB, 8 * MB] * 5))
    slow.observe("d0", samples("p0", 0.0005, 20 * MB, [MB, 8 * MB] * 5))
    plans = {name: plan_prefill("cache_aware", prefill, {}, prompt, {"p0": links.seconds("p0", "d0", nbytes)},
                                cost, 0, local=decode, local_penalty=1.0)
             for name, links in (("fast", fast), ("slow", slow))}
    assert not plans["fast"].local and plans["fast"].worker_id == "p0"
    assert plans["slow"].local and plans["slow"].worker_id == "d0"
