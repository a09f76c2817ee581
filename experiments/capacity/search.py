"""Pool-ratio search, as DistServe does it: for each layout, the highest arrival rate whose simulated
SLO attainment is still >= the target (90% by default), found by bisection; layouts rank by that rate
per worker (goodput per worker). Every rate replays the same `Workload`, stretched in time.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from experiments.capacity.metrics import SLO, Summary, attainment, summarize
from cluster.control.autoscale.profile import BatchShape, EngineProfile
from experiments.capacity.simulator import Layout, SimOptions, simulate
from experiments.capacity.workload import Workload


@dataclass(frozen=True)
class Evaluated:
    layout: Layout
    max_rate_rps: float  # 0: the SLOs are missed even at the lightest load tried
    summary: Summary | None  # at max_rate_rps

    @property
    def per_worker_rps(self) -> float:
        return self.max_rate_rps / self.layout.num_workers

    @property
    def per_gpu_rps(self) -> float:
        return self.max_rate_rps / self.layout.num_gpus


def layouts(max_workers: int, mode: str, tp_sizes: tuple[int, ...] = (1,)) -> list[Layout]:
    """Every disaggregated P:D split and/or colocated count with at most `max_workers` workers, each pool at
    every tensor-parallel size in `tp_sizes` (the prefill and decode pools independently)."""
    if max_workers < 1:
        raise ValueError(f"max_workers must be >= 1, got {max_workers}")
    if mode not in ("disaggregated", "colocated", "both"):
        raise ValueError(f"mode must be disaggregated, colocated or both, got {mode!r}")
    out = []
    if mode in ("disaggregated", "both"):
        out += [Layout("disaggregated", prefill=p, decode=n - p, prefill_tp=tp_p, decode_tp=tp_d)
                for n in range(2, max_workers + 1) for p in range(1, n) for tp_p in tp_sizes for tp_d in tp_sizes]
    if mode in ("colocated", "both"):
        out += [Layout("colocated", colocated=n, colocated_tp=tp) for n in range(1, max_workers + 1) for tp in tp_sizes]
    if not out:
        raise ValueError("a disaggregated layout needs max_workers >= 2")
    return out


def max_rate(profile: EngineProfile | dict[int, EngineProfile], layout: Layout, workload: Workload, slo: SLO, options: SimOptions = SimOptions(),
             target: float = 0.9, rel_tol: float = 0.02) -> float:
    """The highest rate (requests/s) with attainment >= target, to within rel_tol; bracket, then bisect."""
    def ok(rate: float) -> bool:
        return attainment(simulate(profile, layout, workload.at_rate(rate), options), slo) >= target

    mean_prompt = sum(workload.prompt_lens) / len(workload.prompt_lens)
    mean_output = sum(workload.output_lens) / len(workload.output_lens)
    guess = profile  # a first bracket only: the decode (or colocated) pool's costs
    if isinstance(profile, dict):
        guess = profile[layout.decode_tp if layout.mode == "disaggregated" else layout.colocated_tp]
    alone = guess.prefill_s(max(1, round(mean_prompt))) + mean_output * guess.step_s(BatchShape(decode_seqs=1, decode_context=round(mean_prompt)))
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


def evaluate(profile: EngineProfile | dict[int, EngineProfile], layout: Layout, workload: Workload, slo: SLO,
             options: SimOptions = SimOptions(), target: float = 0.9) -> Evaluated:
    rate = max_rate(profile, layout, workload, slo, options, target)
    summary = summarize(simulate(profile, layout, workload.at_rate(rate), options), slo) if rate > 0 else None
    return Evaluated(layout, rate, summary)


def search(profile: EngineProfile | dict[int, EngineProfile], workload: Workload, slo: SLO, max_workers: int,
           mode: str = "both", options: SimOptions = SimOptions(), target: float = 0.9) -> list[Evaluated]:
    """Every layout up to max_workers, best goodput per GPU first (ties: fewer GPUs first). `profile`: one
    for every worker, or one per tensor-parallel size, searched for each pool independently."""
    tp_sizes = tuple(sorted(profile)) if isinstance(profile, dict) else (1,)
    rows = [evaluate(profile, lay, workload, slo, options, target) for lay in layouts(max_workers, mode, tp_sizes)]
    return sorted(rows, key=lambda r: (-round(r.per_gpu_rps, 9), r.layout.num_gpus))


@dataclass(frozen=True)
class Recommendation:
    layout: Layout
    expected_max_rate_rps: float
    why: str

    def yaml(self) -> str:
        lay = self.layout

        def pool(role: str) -> str:
            tp = lay.tp(role)
            return f"{role}:\n  replicas: {getattr(lay, role)}\n" + (f"  tensor_parallel_size: {tp}\n" if tp > 1 else "")

        if lay.mode == "colocated":
            return "mode: colocated\n" + pool("colocated")
        text = "mode: disaggregated\n" + pool("prefill") + pool("decode")
        if lay.prefill_tp > 1 or lay.decode_tp > 1:
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
                              f"highest goodput per GPU ({best.per_gpu_rps:.3g} req/s per GPU, "
                              f"{best.per_worker_rps:.3g} per worker)")
    enough = [r for r in rows if r.max_rate_rps >= target_rate]
    if enough:
        pick = min(enough, key=lambda r: (r.layout.num_gpus, r.layout.num_workers, -r.max_rate_rps))
        return Recommendation(pick.layout, pick.max_rate_rps,
                              f"fewest GPUs (workers) that sustain {target_rate:g} req/s in simulation")
    k = math.ceil(target_rate / best.max_rate_rps)
    lay = best.layout
    scaled = dataclasses.replace(lay, prefill=lay.prefill * k, decode=lay.decode * k, colocated=lay.colocated * k)
    return Recommendation(scaled, best.max_rate_rps * k,
                          f"{k} x the best per-worker layout {lay.describe()} (linear scaling, not simulated)")
