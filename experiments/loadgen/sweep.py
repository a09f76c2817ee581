"""Rate sweeps: the same workload at rising arrival rates, to find the highest rate meeting the SLOs.

With no list of rates, the sweep starts at the spec's rate (light load), multiplies it by `factor`
until attainment drops below the target (saturation), then bisects (geometrically) between the
last passing and the first failing rate `refine` times. Every step sends requests of the same
lengths (workloads are seeded by request index) with fresh token contents, so the server's prefix
cache does not carry over from one step to the next and only the rate differs.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from experiments.loadgen.runner import BenchResult, run_benchmark
from experiments.loadgen.spec import BenchSpec

DEFAULT_TARGET = 0.9


@dataclass
class SweepResult:
    spec: BenchSpec
    target: float
    runs: list[BenchResult]  # by rising rate
    best_rate: float | None  # highest rate tried with attainment >= target

    def to_dict(self, with_requests: bool = True) -> dict:
        return {"sweep": True, "target": self.target, "best_rate": self.best_rate,
                "rates": [r.spec.arrival.rate for r in self.runs],
                "attainment": [r.summary["slo"]["attainment"] for r in self.runs],
                "runs": [r.to_dict(with_requests) for r in self.runs]}

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_dict(), indent=1))
        return path


def sweep(spec: BenchSpec, rates: list[float] | None = None, *, factor: float = 2.0, max_steps: int = 8,
          refine: int = 2, target: float = DEFAULT_TARGET,
          on_run: Callable[[BenchResult], None] | None = None) -> SweepResult:
    """Run `spec` at each of `rates`, or search upward from `spec.arrival.rate` (see the module doc)."""
    if spec.arrival.kind == "closed":
        raise ValueError("a sweep varies the arrival rate; closed-loop arrivals have none (drop --concurrency)")
    if spec.arrival.rate is None:
        raise ValueError("a sweep needs a starting rate (--rate R) or a list of rates (--rates A,B,C)")
    if factor <= 1:
        raise ValueError(f"the sweep factor must be > 1, got {factor}")
    if not 0 < target <= 1:
        raise ValueError(f"the target attainment must be in (0, 1], got {target}")
    results: dict[float, BenchResult] = {}
    spec = spec.with_fixed_salt()
    salt = spec.workload.prompt_salt

    def run(rate: float) -> bool:
        # Fresh prompt contents at each step: the server's prefix cache must not carry over from the last.
        result = run_benchmark(spec.with_rate(rate).with_salt(salt + len(results)))
        results[rate] = result
        if on_run:
            on_run(result)
        return result.summary["slo"]["attainment"] >= target

    if rates:
        if any(r <= 0 for r in rates):
            raise ValueError(f"sweep rates must be positive, got {rates}")
        for rate in sorted(set(rates)):
            run(rate)
    else:
        _search(spec.arrival.rate, factor, max_steps, refine, run)
    ordered = [results[r] for r in sorted(results)]
    passing = [r.spec.arrival.rate for r in ordered if r.summary["slo"]["attainment"] >= target]
    return SweepResult(spec, target, ordered, max(passing) if passing else None)


def _search(start: float, factor: float, max_steps: int, refine: int, run: Callable[[float], bool]) -> None:
    good, bad, rate = None, None, start
    for _ in range(max_steps):
        if run(rate):
            good, rate = rate, rate * factor
        else:
            bad = rate
            break
    if good is None or bad is None:
        return
    for _ in range(refine):
        mid = math.sqrt(good * bad)
        if run(mid):
            good = mid
        else:
            bad = mid
