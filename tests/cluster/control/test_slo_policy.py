"""Mode slo of the autoscaler, without a cluster: the forecast, the pool model, the correction factors,
the stabilization window, the budget; and the elastic simulator it is evaluated on."""

from __future__ import annotations

import math

import pytest

from cluster.control.autoscale.load_policy import Bounds
from cluster.control.autoscale.slo_policy import Corrections, Forecast, PoolModel, SloPolicy, SloTargets
from cluster.control.scheduler.demand import Demand, Observed
from experiments.capacity.elastic import simulate_elastic
from experiments.capacity.roofline import MODEL_PRESETS, roofline_profile
from experiments.capacity.simulator import Layout, simulate
from experiments.capacity.workload import SimRequest

PROFILE = roofline_profile("h100", MODEL_PRESETS["llama3-8b"])
MODEL = PoolModel(PROFILE)
SLO = SloTargets(ttft_s=0.5, tpot_s=0.02)
WIDE = {"prefill": Bounds(1, 32), "decode": Bounds(1, 32)}
PROMPTS = Demand(40.0, 3000, 100)  # prompt-heavy
ANSWERS = Demand(40.0, 500, 1500)  # decode-heavy


def observed(demand: Demand, ttft: float | None = None, tpot: float | None = None, **kw) -> Observed:
    return Observed(demand, ttft, tpot, **kw)


def policy(**kw) -> SloPolicy:
    return SloPolicy(MODEL, SLO, interval_s=10.0, **kw)


def test_trend_forecast_follows_a_ramp_and_constant_repeats_the_last():
    trend, constant = Forecast("trend"), Forecast("constant")
    for rate in (10, 20, 30):
        ahead, same = trend.update(Demand(rate, 100, 10)), constant.update(Demand(rate, 100, 10))
    assert same.rate == 30
    assert 30 < ahead.rate <= 40  # the slope carried one interval on
    assert ahead.prompt_tokens == 100 and ahead.output_tokens == 10  # lengths are not extrapolated
    with pytest.raises(ValueError, match="forecast"):
        Forecast("arima")


def test_the_model_is_monotone_and_saturates():
    ttfts = [MODEL.ttft_s(n, PROMPTS) for n in range(1, 8)]
    tpots = [MODEL.tpot_s(n, ANSWERS) for n in range(1, 12)]
    assert ttfts[:3] == [math.inf] * 3 and all(math.isfinite(t) for t in ttfts[3:])  # 3.6 workers' worth of prompts
    assert ttfts[3:] == sorted(ttfts[3:], reverse=True)
    assert tpots[0] == math.inf  # one worker's KV cannot hold the requests in flight
    finite = [t for t in tpots if math.isfinite(t)]
    assert finite == sorted(finite, reverse=True) and finite[-1] < SLO.tpot_s
    assert MODEL.most_batch(SLO.tpot_s, ANSWERS) < MODEL.most_batch(SLO.tpot_s * 2, ANSWERS)


def test_each_phase_grows_the_pool_it_loads():
    prompts = policy().decide(observed(PROMPTS), {"prefill": 1, "decode": 1}, WIDE, None)
    answers = policy().decide(observed(ANSWERS), {"prefill": 1, "decode": 1}, WIDE, None)
    assert prompts.replicas.get("prefill", 1) > answers.replicas.get("prefill", 1)
    assert answers.replicas.get("decode", 1) > prompts.replicas.get("decode", 1)
    for n, demand in ((prompts.replicas["prefill"], PROMPTS), (answers.replicas["decode"], ANSWERS)):
        assert n >= 2  # and it is the fewest that meets the SLO:
    assert MODEL.ttft_s(prompts.replicas["prefill"], PROMPTS) <= SLO.ttft_s < MODEL.ttft_s(prompts.replicas["prefill"] - 1, PROMPTS)


def test_a_slow_pool_raises_its_correction_and_gets_more_workers():
    plain, corrected = policy(), policy()
    sizes = {"prefill": 4, "decode": 2}
    predicted = MODEL.ttft_s(4, PROMPTS)
    plain.decide(observed(PROMPTS, ttft=predicted), sizes, WIDE, None)
    corrected.decide(observed(PROMPTS, ttft=3 * predicted), sizes, WIDE, None)
    assert plain.corrections.ttft == pytest.approx(1.0)
    assert corrected.corrections.ttft == pytest.approx(2.0)  # half way to 3, smoothed
    again = corrected.decide(observed(PROMPTS, ttft=3 * predicted), sizes, WIDE, None)
    assert again.replicas["prefill"] > (plain.decide(observed(PROMPTS), sizes, WIDE, None).replicas.get("prefill", 4))


def test_workers_still_starting_are_not_counted_as_the_models_error():
    """A decode pool asked to grow from 7 to 10 serves on 7 until the cold starts end: its slow steps are
    what 7 workers give, and the correction must not learn that the model is wrong about 10."""
    sizes = {"prefill": 1, "decode": 10}
    on_seven = MODEL.tpot_s(7, ANSWERS)
    assert math.isfinite(on_seven) and on_seven > MODEL.tpot_s(10, ANSWERS) * 1.2, "precondition: 7 step slower than 10"
    judged, naive = policy(), policy()
    judged.decide(observed(ANSWERS, tpot=on_seven, serving={"prefill": 1, "decode": 7}), sizes, WIDE, None)
    naive.decide(observed(ANSWERS, tpot=on_seven), sizes, WIDE, None)
    assert judged.corrections.tpot == pytest.approx(1.0)
    assert naive.corrections.tpot > 1.1


def test_corrections_ignore_missing_samples_and_stay_in_range():
    c = Corrections()
    c.update(observed(PROMPTS, ttft=None, tpot=1000.0), predicted_ttft=0.1, predicted_tpot=0.01)
    assert c.ttft == 1.0 and c.tpot == pytest.approx((1 + 4.0) / 2)  # 1e5x clamped to 4


def test_shrinking_waits_for_the_stabilization_window_and_growing_does_not():
    p = policy(shrink_window_s=30.0)
    big = {"prefill": 8, "decode": 8}
    quiet = observed(Demand(1.0, 500, 100))
    decisions = [p.decide(quiet, big, WIDE, None) for _ in range(3)]
    assert [d.replicas for d in decisions[:2]] == [{}, {}]  # the pool's size stands for the window's past
    assert decisions[2].replicas["prefill"] < 8 and decisions[2].replicas["decode"] < 8
    assert "hold (wanted 8" in decisions[0].reasons["prefill"]
    grown = p.decide(observed(PROMPTS), {"prefill": 1, "decode": 1}, WIDE, None)
    assert grown.replicas["prefill"] > 1  # at once


def test_queued_work_and_requests_in_flight_are_demand_too():
    sizes = {"prefill": 1, "decode": 1}
    calm = policy().decide(observed(Demand(5.0, 1000, 100)), sizes, WIDE, None)
    backlog = policy().decide(observed(Demand(5.0, 1000, 100), queued=600), sizes, WIDE, None)
    full = policy().decide(observed(Demand(5.0, 1000, 100), decoding=2000, waiting=500, queued=500), sizes, WIDE, None)
    assert backlog.replicas.get("prefill", 1) > calm.replicas.get("prefill", 1)
    assert full.replicas.get("decode", 1) > calm.replicas.get("decode", 1)
    assert full.replicas.get("prefill", 1) == calm.replicas.get("prefill", 1)  # waiting for KV is not prefill work
    assert "in flight or waiting" in full.reasons["decode"]


def test_the_budget_is_shared_in_proportion_to_need():
    d = policy().decide(observed(Demand(200.0, 2000, 800)), {"prefill": 1, "decode": 1}, WIDE, max_workers=10)
    assert sum({"prefill": 1, "decode": 1, **d.replicas}.values()) == 10
    held = policy(shrink_window_s=600.0)
    held.decide(observed(PROMPTS), {"prefill": 8, "decode": 2}, WIDE, max_workers=10)
    moved = held.decide(observed(ANSWERS), {"prefill": 8, "decode": 2}, WIDE, max_workers=10)
    assert moved.replicas["decode"] > 2 and moved.replicas["prefill"] < 8  # the window gives way to the budget
    assert "for the budget" in moved.reasons["prefill"]
    tight = {"prefill": Bounds(3, 8), "decode": Bounds(3, 8)}  # the minimums alone pass the budget
    assert policy().decide(observed(PROMPTS), {"prefill": 3, "decode": 3}, tight, max_workers=4).replicas == {}


def test_with_flips_a_held_pool_gives_its_surplus_to_the_pool_that_grows():
    for flips in (False, True):
        held = policy(shrink_window_s=600.0, flips=flips)
        held.decide(observed(PROMPTS), {"prefill": 8, "decode": 2}, WIDE, None)
        moved = held.decide(observed(ANSWERS), {"prefill": 8, "decode": 2}, WIDE, None)
        grow = moved.replicas["decode"] - 2
        assert grow > 0
        if flips:  # prefill's surplus moves over (to its need at most), without any budget
            unheld = policy(shrink_window_s=0.0).decide(observed(ANSWERS), {"prefill": 8, "decode": 2}, WIDE, None)
            surplus = 8 - unheld.replicas["prefill"]
            assert 8 - moved.replicas["prefill"] == min(grow, surplus) > 0
            assert "to flip into the pool that grows" in moved.reasons["prefill"]
        else:
            assert "prefill" not in moved.replicas  # held by its window


def test_between_decisions_a_new_phase_grows_its_pool_at_once_and_changes_no_forecast_or_correction():
    p = policy(shrink_window_s=60.0)
    sizes = {"prefill": 5, "decode": 2}
    p.decide(observed(PROMPTS, ttft=0.2, tpot=0.009, seconds=10.0), sizes, WIDE, max_workers=14)
    corrections, forecast = (p.corrections.ttft, p.corrections.tpot), p.forecast._level
    two_seconds = observed(ANSWERS, seconds=2.0, decoding=80)  # the first 2 s of long answers
    grown = p.react(two_seconds, sizes, WIDE, max_workers=14)
    assert grown.replicas["decode"] >= 6
    assert (p.corrections.ttft, p.corrections.tpot) == corrections and p.forecast._level == forecast
    assert p.react(observed(PROMPTS, seconds=2.0), sizes, WIDE, None).replicas == {}  # nothing new: nothing moves


def test_a_pool_grown_between_decisions_is_wanted_for_the_shrink_window():
    p = policy(shrink_window_s=60.0)
    sizes = {"prefill": 5, "decode": 2}
    p.decide(observed(PROMPTS, seconds=10.0), sizes, WIDE, None)
    grown = p.react(observed(ANSWERS, seconds=2.0, decoding=80), sizes, WIDE, None)
    sizes = {**sizes, **grown.replicas}
    # The answers stop at once (a short spike): the next decision needs few decode workers, but the ones the
    # check started are held for the window, as a decision's own growth would be, not drained at once.
    quiet = p.decide(observed(Demand(1.0, 500, 100), seconds=10.0), sizes, WIDE, None)
    assert quiet.replicas.get("decode", sizes["decode"]) == sizes["decode"], quiet
    assert f"hold (wanted {sizes['decode']}" in quiet.reasons["decode"]


def test_a_check_between_decisions_grows_a_pool_only_when_it_is_sure_then_for_the_rate_seen():
    p = policy()
    sizes = {"prefill": 1, "decode": 1}
    sizes.update(p.decide(observed(PROMPTS, seconds=10.0), sizes, WIDE, None).replicas)
    # 92 arrivals in 2 s: 46/s would need another prefill worker, but 46/s is within one standard deviation
    # of the 40/s the pool was sized for.
    assert MODEL.fewest(MODEL.ttft_s, SLO.ttft_s, Demand(46.0, 3000, 100), 32) > sizes["prefill"]
    assert p.react(observed(Demand(46.0, 3000, 100), seconds=2.0), sizes, WIDE, None).replicas == {}
    # 160 in 2 s is surely more; the pool is sized for 80/s, the rate seen, not for the sure 71/s.
    surge = p.react(observed(Demand(80.0, 3000, 100), seconds=2.0), sizes, WIDE, None)
    assert surge.replicas["prefill"] == MODEL.fewest(MODEL.ttft_s, SLO.ttft_s, Demand(80.0, 3000, 100), 32)
    assert surge.replicas["prefill"] > MODEL.fewest(MODEL.ttft_s, SLO.ttft_s, Demand(71.0, 3000, 100), 32)


def requests(rate: float, seconds: float, prompt: int, output: int) -> list[SimRequest]:
    return [SimRequest(i / rate, prompt, output) for i in range(int(rate * seconds))]


def test_a_fixed_layout_runs_the_same_elastic_or_not():
    reqs = requests(5.0, 20.0, 500, 20)
    fixed = simulate(PROFILE, Layout.disaggregated(1, 1), reqs)
    elastic = simulate_elastic(PROFILE, Layout.disaggregated(1, 1), reqs, lambda window, sizes: None, interval_s=5.0,
                               end_s=20.0)
    assert [s.finish_s for s in elastic.result.seqs] == [s.finish_s for s in fixed.seqs]
    assert elastic.machine_s == pytest.approx(2 * 20.0)


def test_resizes_start_cold_drain_before_release_and_flip_roles():
    reqs = requests(20.0, 60.0, 2000, 50)
    asked = []

    def controller(window, sizes):
        asked.append((window.end_s, dict(sizes), len(window.arrived)))
        return {10.0: {"prefill": 3, "decode": 1}, 30.0: {"prefill": 1, "decode": 3}}.get(window.end_s)

    cold = simulate_elastic(PROFILE, Layout.disaggregated(1, 1), reqs, controller, 10.0, start_s=15.0, end_s=60.0)
    assert all(s.finish_s is not None and s.rejected is None for s in cold.result.seqs)  # nothing lost on a resize
    assert asked[0] == (10.0, {"prefill": 1, "decode": 1}, 200)
    assert [c.flips for c in cold.changes] == [0, 0]
    assert cold.timeline[-1][1] == {"prefill": 1, "decode": 3}
    served = {s.prefill_worker for s in cold.result.seqs}
    assert "prefill-1" in served  # a new worker served, once started
    first_new = min(s.submitted_s for s in cold.result.seqs if s.prefill_worker == "prefill-1")
    assert first_new >= 10.0 + 15.0  # not before its cold start ended

    asked.clear()
    flipped = simulate_elastic(PROFILE, Layout.disaggregated(1, 1), reqs, controller, 10.0, start_s=15.0, flip_s=1.0,
                               end_s=60.0)
    assert [c.flips for c in flipped.changes] == [0, 2]  # the two drained prefill machines became decode workers
    assert all(s.finish_s is not None for s in flipped.result.seqs)

    def first_on_a_new_decode_worker(run) -> float:
        return min(s.submitted_s for s in run.result.seqs if s.decode_worker not in (None, "decode-0"))

    # The drained prefill machines serve as decode workers a flip (1 s) after the change, not a cold start
    # (15 s); the machine-seconds are the same (a drained machine is released at once, a new one counts
    # from its start).
    assert first_on_a_new_decode_worker(flipped) == pytest.approx(30.0 + 1.0)
    assert first_on_a_new_decode_worker(cold) >= 30.0 + 15.0
    assert flipped.machine_s <= cold.machine_s


def test_a_machine_slower_to_drain_than_a_cold_start_is_not_flipped():
    """Decode workers holding 2,000-token answers (about 20 s to finish) give way to prefill: with a 60 s cold
    start they flip, with a 5 s one they drain and go while new prefill machines start cold."""
    reqs = requests(5.0, 20.0, 200, 2000)

    def controller(window, sizes):
        return {10.0: {"prefill": 3, "decode": 1}}.get(window.end_s)

    slow_start = simulate_elastic(PROFILE, Layout.disaggregated(1, 3), reqs, controller, 10.0, start_s=60.0,
                                  flip_s=1.0, end_s=60.0)
    fast_start = simulate_elastic(PROFILE, Layout.disaggregated(1, 3), reqs, controller, 10.0, start_s=5.0,
                                  flip_s=1.0, end_s=60.0)
    assert [c.flips for c in slow_start.changes] == [2]
    assert [c.flips for c in fast_start.changes] == [0]
    for run in (slow_start, fast_start):
        assert all(s.finish_s is not None and s.rejected is None for s in run.result.seqs)
        assert run.timeline[-1][1] == {"prefill": 3, "decode": 1}


def test_the_controller_waits_for_flips_not_cold_starts_and_a_pool_still_starting_is_not_shrunk():
    """As the product's autoscaler resizes (`scale(..., wait=False)`): the loop is held while a flip drains and
    switches, not while a new worker loads; the ticks held back reach the controller as one window; a
    pool whose new worker still starts is refused a shrink."""
    reqs = requests(5.0, 40.0, 500, 200)
    asked = []

    def controller(window, sizes):
        asked.append((window.start_s, window.end_s))
        return {5.0: {"prefill": 1, "decode": 2}, 10.0: {"prefill": 1, "decode": 1},
                20.0: {"prefill": 1, "decode": 1}}.get(window.end_s)

    cold = simulate_elastic(PROFILE, Layout.disaggregated(1, 1), reqs, controller, 5.0, start_s=12.0, end_s=40.0,
                            blocking=True)
    assert [end for _, end in asked][:4] == [5.0, 10.0, 15.0, 20.0]  # decode-1 loads until 17 s: nothing held
    assert [c.at_s for c in cold.changes] == [5.0, 20.0]  # at 10 s it was still starting: no shrink until it serves
    assert cold.timeline[-1][1] == {"prefill": 1, "decode": 1}

    asked.clear()
    prompts = requests(4.0, 40.0, 8000, 20)  # long prompts: a prefill worker has seconds of them queued

    def flip_one(window, sizes):
        asked.append((window.start_s, window.end_s))
        return {"prefill": 1, "decode": 2} if window.end_s == 5.0 else None

    flipped = simulate_elastic(PROFILE, Layout.disaggregated(2, 1), prompts, flip_one, 1.0, start_s=60.0, flip_s=3.0,
                               end_s=40.0, blocking=True)
    assert [c.flips for c in flipped.changes] == [1]
    after = asked[5]  # the first call after the flip: it began where the last one ended, at 5 s
    assert after[0] == 5.0 and after[1] >= 5.0 + 3.0 + 1.0  # held for the drain and the 3 s switch
    assert all(end - start == 1.0 for start, end in asked[6:])
