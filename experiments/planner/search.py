"""Pool-ratio search, as DistServe does it: for each layout, the highest arrival rate whose simulated
SLO attainment is still >= the target (90% by default), found by bisection; layouts rank by that rate
per worker (goodput per worker). Every rate replays the same `Workload`, stretched in time.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from experiments.planner.metrics import SLO, Summary, attainment, summarize
from experiments.planner.profile import BatchShape, EngineProfile
from experiments.planner.simulator import Layout, SimOptions, simulate
from experiments.planner.workload import Workload


@dataclass(frozen=True)
class Evaluated:
    layout: Layout
    max_rate_rps: float  # 0: the SLOs are missed even at the lightest load tried
    summary: Summary | None  # at max_rate_rps

    @property
    def per_worker_rps(self) -> float:
        return self.max_rate_rps / self.layout.num_workers


def layouts(max_workers: int, mode: str) -> list[Layout]:
    """Every disaggregated P:D split and/or colocated count with at most `max_workers` workers."""
    if max_workers < 1:
        raise ValueError(f"max_workers must be >= 1, got {max_workers}")
    if mode not in ("disaggregated", "colocated", "both"):
        raise ValueError(f"mode must be disaggregated, colocated or both, got {mode!r}")
    out = []
    if mode in ("disaggregated", "both"):
        out += [Layout.disaggregated(p, n - p) for n in range(2, max_workers + 1) for p in range(1, n)]
    if mode in ("colocated", "both"):
        out += [Layout.colocated_workers(n) for n in range(1, max_workers + 1)]
    if not out:
        raise ValueError("a disaggregated layout needs max_workers >= 2")
    return out


def max_rate(profile: EngineProfile, layout: Layout, workload: Workload, slo: SLO, options: SimOptions = SimOptions(),
             target: float = 0.9, rel_tol: float = 0.02) -> float:
    """The highest rate (requests/s) with attainment >= target, to within rel_tol; bracket, then bisect."""
    def ok(rate: float) -> bool:
        return attainment(simulate(profile, layout, workload.at_rate(rate), options), slo) >= target

    mean_prompt = sum(workload.prompt_lens) / len(workload.prompt_lens)
    mean_output = sum(workload.output_lens) / len(workload.output_lens)
    alone = profile.prefill_s(max(1, round(mean_prompt))) + mean_output * profile.step_s(BatchShape(decode_seqs=1, decode_context=round(mean_prompt)))
    lo, hi = 0.0, layout.num_workers / alone
    if ok(hi):
        for _ in range(40):
            lo, hi = hi, hi * 2
            if not ok(hi):
                break
        else:
            return lo
    else:
        for _ in range(20):
            if ok(hi / 2):
                lo = hi / 2
                break
            hi /= 2
        else:
            return 0.0
    while hi - lo > rel_tol * hi:
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    return lo


def evaluate(profile: EngineProfile, layout: Layout, workload: Workload, slo: SLO,
             options: SimOptions = SimOptions(), target: float = 0.9) -> Evaluated:
    rate = max_rate(profile, layout, workload, slo, options, target)
    summary = summarize(simulate(profile, layout, workload.at_rate(rate), options), slo) if rate > 0 else None
    return Evaluated(layout, rate, summary)


def search(profile: EngineProfile, workload: Workload, slo: SLO, max_workers: int, mode: str = "both",
           options: SimOptions = SimOptions(), target: float = 0.9) -> list[Evaluated]:
    """Every layout up to max_workers, best goodput per worker first (ties: fewer workers first)."""
    rows = [evaluate(profile, lay, workload, slo, options, target) for lay in layouts(max_workers, mode)]
    return sorted(rows, key=lambda r: (-round(r.per_worker_rps, 9), r.layout.num_workers))


@dataclass(frozen=True)
class Recommendation:
    layout: Layout
    expected_max_rate_rps: float
    why: str

    def yaml(self, tensor_parallel: int = 1) -> str:
        lay = self.layout
        tp = f"  tensor_parallel_size: {tensor_parallel}\n" if tensor_parallel > 1 else ""
        if lay.mode == "colocated":
            return f"mode: colocated\ncolocated:\n  replicas: {lay.colocated}\n{tp}"
        text = f"mode: disaggregated\nprefill:\n  replicas: {lay.prefill}\n{tp}decode:\n  replicas: {lay.decode}\n{tp}"
        if tp:
            text = "# tandem serve does not run tensor-parallel prefill and decode pools yet (no TP handoff)\n" + text
        return text


def recommend(rows: list[Evaluated], target_rate: float | None = None) -> Recommendation:
    """Without a target: the best layout per worker. With one: the smallest searched layout that sustains
    it, else the best per-worker layout replicated enough times (its predicted rate scales linearly)."""
    best = rows[0]
    if best.max_rate_rps <= 0:
        raise ValueError("no layout meets the SLOs even at the lightest load: loosen --slo-ttft-ms / --slo-tpot-ms")
    if target_rate is None:
        return Recommendation(best.layout, best.max_rate_rps,
                              f"highest goodput per worker ({best.per_worker_rps:.3g} req/s per worker)")
    enough = [r for r in rows if r.max_rate_rps >= target_rate]
    if enough:
        pick = min(enough, key=lambda r: (r.layout.num_workers, -r.max_rate_rps))
        return Recommendation(pick.layout, pick.max_rate_rps,
                              f"fewest workers that sustain {target_rate:g} req/s in simulation")
    k = math.ceil(target_rate / best.max_rate_rps)
    lay = best.layout
    scaled = Layout(lay.mode, lay.prefill * k, lay.decode * k, lay.colocated * k)
    return Recommendation(scaled, best.max_rate_rps * k,
                          f"{k} x the best per-worker layout {lay.describe()} (linear scaling, not simulated)")
