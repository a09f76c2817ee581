"""`tandem bench autoscale`'s autoscaler run: the product's SloPolicy deciding in the elastic simulator,
checking between decisions every `react_s` as the product's loop does."""

from __future__ import annotations

import pytest

from cluster.control.autoscale.load_policy import Bounds
from cluster.control.autoscale.slo_policy import Forecast, PoolModel, SloPolicy, SloTargets
from experiments.capacity.elastic import simulate_elastic
from experiments.capacity.roofline import MODEL_PRESETS, roofline_profile
from experiments.capacity.simulator import Layout
from experiments.autoscale.cli import _floors
from experiments.autoscale.runs import SloController, observe
from experiments.autoscale.trace import Phase, draw

PROFILE = roofline_profile("h100", MODEL_PRESETS["llama3-8b"])
BOUNDS = {"prefill": Bounds(1, 13), "decode": Bounds(1, 13)}
# 30 s of long prompts, then long answers: the decode pool must grow several-fold.
TRACE = draw([Phase("prompts", 30.0, 40.0, 3000, 100), Phase("answers", 40.0, 40.0, 500, 1500)], seed=0)


def run(react_s: float | None) -> SloController:
    policy = SloPolicy(PoolModel(PROFILE), SloTargets(0.5, 0.02), 10.0, Forecast("trend"), flips=True)
    controller = SloController(policy, BOUNDS, 14, 90.0, react_s)
    simulate_elastic(PROFILE, Layout.disaggregated(5, 2), TRACE, controller, controller.period_s, start_s=30.0,
                     flip_s=5.0, end_s=70.0, blocking=True)
    return controller


def test_a_new_phase_is_met_seconds_after_it_starts_not_at_the_next_decision():
    checked, plain = run(react_s=2.0), run(react_s=None)
    decisions = [d for d in checked.decisions if not d["react"]]
    assert [d["at_s"] for d in decisions][:3] == [10.0, 20.0, 30.0]  # the intervals' decisions keep their times
    grown = next(d for d in checked.decisions if d["changes"].get("decode", 0) > 2)
    assert grown["react"] and 30.0 < grown["at_s"] < 40.0, grown  # between decisions, within seconds
    late = next(d for d in plain.decisions if d["changes"].get("decode", 0) > 2)
    assert late["at_s"] == 40.0  # without the checks: the first decision that saw the phase
    assert all(d["at_s"] % 10.0 == 0 for d in plain.decisions)


def test_a_check_sizes_for_the_newest_seconds_not_a_window_that_blends_the_phases():
    """The answers begin 5 s into an interval: a window from the last decision would hold 5 s of 100-token
    answers and size the decode pool for a mean far below 1,500."""
    trace = draw([Phase("prompts", 35.0, 40.0, 3000, 100), Phase("answers", 35.0, 40.0, 500, 1500)], seed=0)
    policy = SloPolicy(PoolModel(PROFILE), SloTargets(0.5, 0.02), 10.0, Forecast("trend"), flips=True)
    controller = SloController(policy, BOUNDS, 14, 90.0, react_s=2.0)
    simulate_elastic(PROFILE, Layout.disaggregated(5, 2), trace, controller, 2.0, start_s=30.0, flip_s=5.0,
                     end_s=70.0, blocking=True)
    grown = next(d for d in controller.decisions if d["changes"].get("decode", 0) > 2)
    assert grown["react"] and 35.0 < grown["at_s"] < 40.0
    # Its 2 s hold at most 1 s of the old phase (a mean past 600 tokens); the 6 s since the last decision at
    # 30 s would hold 5 s of it (a mean near 330).
    assert grown["observed"]["output_tokens"] > 600, grown["observed"]


def test_tpot_is_read_as_the_product_reads_it_the_slowest_decode_workers_step():
    seen = []
    simulate_elastic(PROFILE, Layout.disaggregated(1, 2), TRACE[:200], lambda window, sizes: seen.append(window),
                     5.0, end_s=30.0)
    stepped = [w for w in seen if w.decode_step_s]
    assert stepped and all(0 < t < 1.0 for w in stepped for t in w.decode_step_s)
    window = stepped[-1]
    assert observe(window, 90.0, None).tpot_s == max(window.decode_step_s)  # not the finished requests' TPOT


def test_min_replicas_must_be_a_pair_of_floors_within_the_budget():
    assert _floors("1:4", 14) == (1, 4)
    for bad, named in (("4", "must be P:D"), ("0:3", ">= 1 of each pool"), ("8:8", r"P \+ D <= --budget \(14\)")):
        with pytest.raises(ValueError, match=named) as err:
            _floors(bad, 14)
        assert "--min-replicas" in str(err.value)
