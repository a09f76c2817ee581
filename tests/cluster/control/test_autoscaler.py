"""The autoscaler end to end on a real cluster, with its shipped settings (mode load): requests that wait for
KV room grow the decode pool by a worker that takes them, the cool-down holds the next resize, and once
the load is gone the pool shrinks back without failing a request or leaving a block behind. Mode slo does
the same from the demand the scheduler saw and a profile of the pools, its window holding the shrink."""

from __future__ import annotations

import time

import httpx
import pytest
import ray

from actors.protocol.sampling_params import SamplingParams
from cluster.control.autoscale.autoscaler import Autoscaler
from cluster.control.autoscale.profile import EngineLimits, EngineProfile, LinearCost, ModelShape
from cluster.control.config import AutoscalerSection, SloSection
from cluster.control.lifecycle.launch import Cluster
from cluster.frontend.http.server import make_server
from tests.helpers.cluster import generate_in_background, load, wait_until_idle, wait_until_resized
from tests.helpers.http_server import running

pytestmark = pytest.mark.slow  # pools resized with workers started and drained
PROMPT = list(range(20, 52))
# 32 + 2,000 tokens: 128 blocks of 16 committed per request; the decode worker's 320 hold two.
PARAMS = SamplingParams(temperature=0.0, max_tokens=2000, ignore_eos=True)


def _waiting(cluster: Cluster) -> int:
    loads = ray.get(cluster.scheduler.pool_load.remote(), timeout=10)
    return sum(load.waiting for load in loads)


def _room_for_a_second_decode_worker() -> Cluster:
    config = load("local.yaml", num_kv_blocks=320)
    return Cluster.start(config.model_copy(update={"decode": config.decode.model_copy(update={"max_replicas": 2})}))


def _three_requests_one_waiting(cluster: Cluster):
    """Three 2,000-token answers: two run on the decode worker, the third waits for KV room."""
    runner, out = generate_in_background(cluster, [PROMPT] * 3, PARAMS)
    deadline = time.monotonic() + 60
    while _waiting(cluster) < 1:
        assert time.monotonic() < deadline, "no request ever waited for KV room"
        time.sleep(0.1)
    return runner, out


def _all_exact_and_nothing_left(cluster: Cluster, runner, out) -> None:
    """The three greedy requests all ran to their length with the same answer, and no KV is left behind."""
    runner.join(timeout=240)
    results = [r[0] for r in out["got"]]
    assert [r.finish_reason for r in results] == ["length"] * 3, [r.error for r in results]
    assert results[0].token_ids == results[1].token_ids == results[2].token_ids
    state = wait_until_idle(cluster)
    assert all(w["used_blocks"] == w["reserved"] == w["held"] == 0 for w in state["workers"].values())


def test_waiting_requests_grow_the_decode_pool_and_idle_shrinks_it(ray_session):
    cluster = _room_for_a_second_decode_worker()
    try:
        section = AutoscalerSection(mode="load")
        assert (section.interval_s, section.cooldown_s) == (10.0, 30.0)  # the shipped ones; ticks driven here
        autoscaler = Autoscaler(cluster, section)
        assert autoscaler.tick().outcome == "held"  # idle, at its least: nothing to do
        runner, out = generate_in_background(cluster, [PROMPT] * 3, PARAMS)
        deadline = time.monotonic() + 60
        while _waiting(cluster) < 1:  # two run, the third waits for KV room
            assert time.monotonic() < deadline, "no request ever waited for KV room"
            time.sleep(0.1)
        grown = autoscaler.tick()
        assert grown.decision.replicas == {"decode": 2} and grown.outcome == "resized", grown
        assert grown.loads["decode"].waiting >= 1 and "grow" in grown.decision.reasons["decode"]
        assert sorted(cluster.workers) == ["decode-0", "decode-1", "prefill-0"]
        assert autoscaler.resizes == {("decode", "up"): 1}
        runner.join(timeout=240)
        results = [r[0] for r in out["got"]]
        assert [r.finish_reason for r in results] == ["length"] * 3, [r.error for r in results]
        assert results[0].token_ids == results[1].token_ids == results[2].token_ids  # greedy, on either worker
        stats = ray.get(cluster.scheduler.state.remote(), timeout=10).worker_stats
        # The new worker served the waiting request (a short prompt: prefilled there or handed off to it);
        # a worker that never had a request has never stepped.
        assert stats["decode-1"].step_s is not None
        wait_until_idle(cluster)
        held = autoscaler.tick()  # idle now, but within the cool-down of the last resize
        assert held.decision.replicas == {"decode": 1} and held.outcome == "cooling down", held
        # A fresh autoscaler (say `tandem serve` restarted) has no cool-down to wait out.
        shrunk = Autoscaler(cluster, section).tick()
        assert shrunk.outcome == "resized" and cluster.config.decode.replicas == 1, shrunk  # at once: it drains meanwhile
        wait_until_resized(cluster)
        assert sorted(cluster.workers) == ["decode-0", "prefill-0"]
        assert cluster.config.decode.replicas == 1
        with running(make_server(cluster, "127.0.0.1", 0, autoscaler=autoscaler)) as url:  # as `tandem serve`
            metrics = httpx.get(url + "/metrics", timeout=30).text
        assert 'tandem:autoscaler_resizes_total{direction="up",pool="decode"} 1.0' in metrics, metrics
        assert 'tandem:autoscaler_replicas{pool="decode"} 1.0' in metrics
        assert 'tandem:autoscaler_waiting_requests{pool="decode"} 0.0' in metrics
        state = wait_until_idle(cluster)
        assert state["scheduler"]["in_flight"] == 0
        assert all(w["used_blocks"] == w["reserved"] == w["held"] == 0 for w in state["workers"].values())
    finally:
        cluster.shutdown()


def _profile(path) -> str:
    """A hand-written profile of the tiny model on this box's workers: KV for 320 blocks of 16, as configured."""
    model = ModelShape("tiny-llama", num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16,
                       intermediate_size=128, vocab_size=512)
    profile = EngineProfile("measured", "this box", model, LinearCost(0.005, 2e-5, 0.0, 0.005, 1e-4, 1e-7),
                            EngineLimits(16, 320, 64, 2048))
    profile.save(path)
    return str(path)


def test_mode_slo_sizes_the_decode_pool_for_the_requests_it_holds(ray_session, tmp_path):
    cluster = _room_for_a_second_decode_worker()
    try:
        slo = SloSection(ttft_ms=2000, tpot_ms=200, profile=_profile(tmp_path / "profile.json"))
        assert (slo.percentile, slo.forecast, slo.shrink_window_s, slo.headroom) == (90.0, "trend", 60.0, 0.0)
        autoscaler = Autoscaler(cluster, AutoscalerSection(mode="slo", slo=slo))
        assert autoscaler.tick().decision.replicas == {}  # no demand: the pools stay at their least
        runner, out = _three_requests_one_waiting(cluster)
        grown = autoscaler.tick()
        assert grown.decision.replicas == {"decode": 2} and grown.outcome == "resized", grown
        assert grown.observed.demand.output_tokens == 2000 and grown.observed.waiting >= 1
        assert grown.observed.demand.rate > 0 and grown.decision.reasons["decode"].startswith("2 workers")
        # The resize returned with the new worker still starting (a process that imports torch and loads
        # weights: seconds); the next interval is judged at the one decode worker that served it.
        starting = autoscaler.tick()
        assert starting.replicas == {"prefill": 1, "decode": 2}, starting
        assert starting.observed.serving == {"prefill": 1, "decode": 1}, starting
        runner.join(timeout=240)
        results = [r[0] for r in out["got"]]
        assert [r.finish_reason for r in results] == ["length"] * 3, [r.error for r in results]
        assert results[0].token_ids == results[1].token_ids == results[2].token_ids
        wait_until_idle(cluster)
        held = autoscaler.tick()  # idle, but it wanted 2 decode workers within the window
        assert held.decision.replicas == {} and "hold (wanted 2" in held.decision.reasons["decode"], held
        with running(make_server(cluster, "127.0.0.1", 0, autoscaler=autoscaler)) as url:
            metrics = httpx.get(url + "/metrics", timeout=30).text
        assert 'tandem:autoscaler_correction{metric="tpot"}' in metrics and "tandem:autoscaler_arrival_rate" in metrics
        eager = Autoscaler(cluster, AutoscalerSection(mode="slo", slo=slo.model_copy(update={"shrink_window_s": 0})))
        shrunk = eager.tick()
        assert shrunk.decision.replicas == {"decode": 1} and shrunk.outcome == "resized", shrunk
        wait_until_resized(cluster)
        assert sorted(cluster.workers) == ["decode-0", "prefill-0"]
        state = wait_until_idle(cluster)
        assert all(w["used_blocks"] == w["reserved"] == w["held"] == 0 for w in state["workers"].values())
    finally:
        cluster.shutdown()


def test_mode_slo_grows_a_pool_between_decisions_and_the_next_decision_keeps_it(ray_session, tmp_path):
    cluster = _room_for_a_second_decode_worker()
    try:
        slo = SloSection(ttft_ms=2000, tpot_ms=200, profile=_profile(tmp_path / "profile.json"))
        autoscaler = Autoscaler(cluster, AutoscalerSection(mode="slo", slo=slo))
        assert (slo.react_s, autoscaler.react_s, autoscaler._loop.interval_s) == (2.0, 2.0, 2.0)  # shipped
        assert autoscaler.tick().decision.replicas == {}  # a decision on no demand
        runner, out = _three_requests_one_waiting(cluster)
        autoscaler._next_decision = time.monotonic() + autoscaler.section.interval_s  # as the loop's start sets it
        autoscaler._step()  # the loop's step, 8 s before the next decision: a check for growth
        grown = autoscaler.history[-1]
        assert grown.react and grown.decision.replicas == {"decode": 2} and grown.outcome == "resized", grown
        assert grown.observed.demand.output_tokens == 2000 and 0 < grown.observed.seconds < 60
        assert autoscaler.resizes == {("decode", "up"): 1}
        autoscaler._step()  # at its most now: nothing more to grow, and a check that grows nothing leaves no record
        assert autoscaler.history[-1] is grown
        decided = autoscaler.tick()  # the interval's decision: the pool it grew is wanted, not shrunk back
        assert decided.decision.replicas == {} and not decided.react, decided
        assert decided.observed.demand.rate > 0  # it saw the arrivals the check saw: the window runs from the last decision
        _all_exact_and_nothing_left(cluster, runner, out)
    finally:
        cluster.shutdown()


def test_mode_slo_flips_a_held_prefill_worker_into_the_short_decode_pool(ray_session, tmp_path):
    config = load("local.yaml", num_kv_blocks=320)
    config = config.model_copy(update={"prefill": config.prefill.model_copy(update={"replicas": 2, "max_replicas": 2}),
                                       "decode": config.decode.model_copy(update={"max_replicas": 2})})
    cluster = Cluster.start(config)
    try:
        slo = SloSection(ttft_ms=2000, tpot_ms=200, profile=_profile(tmp_path / "profile.json"))
        autoscaler = Autoscaler(cluster, AutoscalerSection(mode="slo", slo=slo))
        assert autoscaler.section.flips  # the shipped setting
        process = ray.get(cluster.workers["prefill-1"].__ray_call__.remote(lambda _: __import__("os").getpid()),
                          timeout=30)
        runner, out = _three_requests_one_waiting(cluster)
        # The premise: the worker to flip holds no handoff (under load one can still be on its way to the
        # decode worker when the third request starts waiting; a flip must then wait for its drain, and
        # the scaler rightly starts a worker cold when that drain may outlast a cold start).
        deadline = time.monotonic() + 60
        while ray.get(cluster.workers["prefill-1"].drain_estimate_s.remote(), timeout=30) > 0:
            assert time.monotonic() < deadline, "prefill-1 never let go of what it held"
            time.sleep(0.1)
        moved = autoscaler.tick()  # prefill wants 1 but its window holds 2: the surplus flips to decode
        assert moved.decision.replicas == {"prefill": 1, "decode": 2}, moved
        assert moved.outcome == "resized (1 by role flips)", moved
        assert "to flip into the pool that grows" in moved.decision.reasons["prefill"]
        assert sorted(cluster.workers) == ["decode-0", "decode-1", "prefill-0"]
        assert ray.get(cluster.workers["decode-1"].__ray_call__.remote(lambda _: __import__("os").getpid()),
                       timeout=30) == process  # the same process: no cold start
        assert autoscaler.flips == {("prefill", "decode"): 1}
        with running(make_server(cluster, "127.0.0.1", 0, autoscaler=autoscaler)) as url:
            metrics = httpx.get(url + "/metrics", timeout=30).text
        assert 'tandem:autoscaler_flips_total{from_pool="prefill",to_pool="decode"} 1.0' in metrics, metrics
        deadline = time.monotonic() + 60
        while ray.get(cluster.workers["decode-1"].check_integrity.remote(), timeout=30).used_blocks == 0:
            assert time.monotonic() < deadline, "the waiting request never went to the flipped worker"
            time.sleep(0.1)
        _all_exact_and_nothing_left(cluster, runner, out)
    finally:
        cluster.shutdown()
