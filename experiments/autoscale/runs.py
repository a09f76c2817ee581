"""The two runs of `tandem bench autoscale` on one trace: the best static layout and the SLO autoscaler.

Both run in the capacity simulator (experiments/capacity/): the static layouts through `simulate`,
the autoscaler through `simulate_elastic`, with the product's own `SloPolicy` deciding every interval
from what the interval showed, exactly as `autoscaler.mode: slo` does from the ingress's observations.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from cluster.control.autoscale.load_policy import Bounds
from cluster.control.autoscale.slo_policy import SloPolicy
from cluster.control.scheduler.demand import Demand, Observed
from experiments.capacity.elastic import ElasticRun, Window, simulate_elastic
from experiments.capacity.metrics import SLO, request_latencies
from cluster.control.autoscale.profile import EngineProfile
from experiments.capacity.simulator import Layout, SimOptions, SimResult, simulate
from experiments.capacity.workload import SimRequest


@dataclass
class Outcome:
    name: str
    layout: str  # the static layout, or the autoscaler's start
    good: list[bool]  # per request, in trace order: finished within both SLOs
    machine_s: float
    timeline: list[tuple[float, dict[str, int]]]
    decisions: list[dict] = field(default_factory=list)
    flips: int = 0


def observe(window: Window, percentile: float, last: Demand | None) -> Observed:
    """What the frontend would report of an interval: arrivals and their mean lengths, the percentile of the
    TTFTs measured in it and the decode workers' step time at its end. An arrival's output length is known
    here as a client's `max_tokens` is (a trace replayed with its lengths sets max_tokens to them, as `vllm bench serve` does)."""
    span = window.end_s - window.start_s
    prompt = np.mean([s.request.prompt_len for s in window.arrived]) if window.arrived else (
        last.prompt_tokens if last else 1.0)
    output = np.mean([s.request.output_len for s in window.arrived]) if window.arrived else (
        last.output_tokens if last else 1.0)
    ttfts = [s.first_token_s - s.submitted_s for s in window.first_tokens]  # placement -> first token
    pick = (lambda xs: float(np.percentile(xs, percentile)) if xs else None)
    # TPOT as the product reads it: the slowest decode worker's smoothed step time now (a finished request's
    # TPOT would tell of a long answer only once it ends, half a minute late).
    tpot = max(window.decode_step_s) if window.decode_step_s else None
    return Observed(Demand(len(window.arrived) / span, float(prompt), float(output)), pick(ttfts), tpot,
                    queued=len(window.queued), waiting=sum(1 for s in window.queued if s.submitted_s is None),
                    decoding=len(window.decoding), seconds=span, serving=window.serving)


class SloController:
    """`SloPolicy` as the elastic simulator's controller; keeps every decision for the report. With
    `react_s` it is called every `react_s`: each call checks whether a pool must grow now (`SloPolicy.react`
    on the newest window's demand), and every `interval_s` it decides on the whole interval, as the
    product's autoscaler does."""

    def __init__(self, policy: SloPolicy, bounds: dict[str, Bounds], max_workers: int, percentile: float,
                 react_s: float | None = None):
        self.policy, self.bounds, self.max_workers, self.percentile = policy, bounds, max_workers, percentile
        self.react_s = react_s
        self.decisions: list[dict] = []
        self._last: Demand | None = None
        self._since: Window | None = None  # the windows since the last decision, merged

    @property
    def period_s(self) -> float:
        """How often the simulator calls it."""
        return self.react_s or self.policy.interval_s

    def __call__(self, window: Window, sizes: dict[str, int]) -> dict[str, int] | None:
        self._since = window if self._since is None else self._since.then(window)
        at_decision = self._since.end_s - self._since.start_s >= self.policy.interval_s - 1e-9
        if at_decision:
            observed = observe(self._since, self.percentile, self._last)
            self._since = None
            self._last = observed.demand
            decision = self.policy.decide(observed, sizes, self.bounds, self.max_workers)
        else:  # the newest window alone: one that ran from the last decision would blend a new phase with the old
            observed = observe(window, self.percentile, self._last)
            decision = self.policy.react(observed, sizes, self.bounds, self.max_workers)
            if not decision.replicas:
                return None
        self.decisions.append({
            "at_s": window.end_s, "sizes": sizes, "changes": decision.replicas, "reasons": decision.reasons,
            "react": not at_decision,
            "observed": {"rate": observed.demand.rate, "prompt_tokens": observed.demand.prompt_tokens,
                         "output_tokens": observed.demand.output_tokens, "ttft_s": observed.ttft_s,
                         "tpot_s": observed.tpot_s},
            "corrections": {"ttft": self.policy.corrections.ttft, "tpot": self.policy.corrections.tpot},
        })
        return {**sizes, **decision.replicas} if decision.replicas else None


def good_flags(result: SimResult, slo: SLO) -> list[bool]:
    return [r.good for r in request_latencies(result, slo)]


def best_static(profile: EngineProfile, requests: list[SimRequest], slo: SLO, budget: int, duration_s: float,
                prefills: list[int] | None = None, options: SimOptions = SimOptions()) -> tuple[Outcome, list[dict]]:
    """Every prefill:decode split of the whole budget (or those with `prefills` prefill workers) over the
    whole trace; the one with the most requests within both SLOs."""
    tried, best = [], None
    for prefill in prefills or range(1, budget):
        layout = Layout.disaggregated(prefill, budget - prefill)
        good = good_flags(simulate(profile, layout, requests, options), slo)
        tried.append({"layout": layout.describe(), "goodput_rps": sum(good) / duration_s})
        if best is None or sum(good) > sum(best[1]):
            best = (layout, good)
    layout, good = best
    sizes = {"prefill": layout.prefill, "decode": layout.decode}
    return Outcome("static", layout.describe(), good, budget * duration_s, [(0.0, sizes)]), tried


def autoscaled(profile: EngineProfile, requests: list[SimRequest], slo: SLO, controller: SloController,
               start: Layout, start_s: float, flip_s: float | None, duration_s: float,
               name: str = "autoscaler", options: SimOptions = SimOptions(), blocking: bool = True) -> Outcome:
    run: ElasticRun = simulate_elastic(profile, start, requests, controller, controller.period_s, start_s, flip_s,
                                       options, end_s=duration_s, blocking=blocking)
    return Outcome(name, start.describe(), good_flags(run.result, slo), run.machine_s, run.timeline,
                   controller.decisions, sum(c.flips for c in run.changes))
