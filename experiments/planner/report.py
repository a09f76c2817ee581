"""The search as a terminal table and as one JSON document."""

from __future__ import annotations

import argparse
from dataclasses import asdict

from cluster.control.autoscale.profile import EngineProfile
from experiments.capacity.search import Evaluated, Recommendation


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1e3:.1f}"


def print_table(rows: list[Evaluated]) -> None:
    print(f"\n{'layout':>11} {'workers':>7} {'GPUs':>4} {'max rate':>9} {'per GPU':>8} {'attain':>6} "
          f"{'TTFT p90':>9} {'TPOT p90':>9} {'ITL p99':>8}   (rates in req/s, latencies in ms at the max rate)")
    for r in rows:
        s = r.summary
        cells = ("-", "-", "-", "-") if s is None else (
            f"{s.attainment:.2f}", _ms(s.ttft.p90), _ms(s.tpot.p90), _ms(s.itl.p99))
        print(f"{r.layout.describe():>11} {r.layout.num_workers:>7} {r.layout.num_gpus:>4} {r.max_rate_rps:>9.3g} "
              f"{r.per_gpu_rps:>8.3g} "
              f"{cells[0]:>6} {cells[1]:>9} {cells[2]:>9} {cells[3]:>8}")


def result_json(profile: EngineProfile | dict[int, EngineProfile], args: argparse.Namespace, rows: list[Evaluated], rec: Recommendation) -> dict:
    settings = {k: v for k, v in vars(args).items() if k != "func"}
    return {
        "profiles": {str(tp): p.to_json() | {"samples": len(p.samples)} for tp, p in _by_tp(profile).items()},
        "settings": settings,
        "layouts": [{"layout": asdict(r.layout), "name": r.layout.describe(), "workers": r.layout.num_workers,
                     "gpus": r.layout.num_gpus, "max_rate_rps": r.max_rate_rps, "per_worker_rps": r.per_worker_rps,
                     "per_gpu_rps": r.per_gpu_rps,
                     "at_max_rate": None if r.summary is None else r.summary.to_json()} for r in rows],
        "recommendation": {"layout": asdict(rec.layout), "name": rec.layout.describe(),
                           "expected_max_rate_rps": rec.expected_max_rate_rps, "why": rec.why, "yaml": rec.yaml()},
    }


def _by_tp(profile: EngineProfile | dict[int, EngineProfile]) -> dict[int, EngineProfile]:
    return profile if isinstance(profile, dict) else {1: profile}
