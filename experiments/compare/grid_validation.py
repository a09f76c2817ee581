"""The planner's goodput against a compare's measured goodput at every SLO pair of its re-scoring grid
(0.5x, 1x, 2x of each SLO), for the in-process profile and, where the run has one, the profile refitted
on the layout's calibration steps. One simulation per layout and profile; only the scoring changes.

Usage: python -m experiments.compare.grid_validation COMPARE.json [PROFILE.json]
(PROFILE defaults to the `<stem>_profile.json` that --measure-profile wrote beside the JSON.)
"""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path

from experiments.capacity.metrics import SLO, summarize
from cluster.control.autoscale.profile import EngineLimits, EngineProfile, LinearCost
from experiments.capacity.simulator import Layout, SimOptions, SimResult, simulate
from cluster.control.config import TandemConfig
from experiments.compare.predict import requests_of
from experiments.compare.report import measured_runs
from experiments.compare.rescore import good_count, slo_grid


def predicted_grid(profile: EngineProfile, config: TandemConfig, run: dict, grid: list[dict]) -> list[float]:
    profile = replace(profile, engine=EngineLimits.from_config(config))
    requests, measured = requests_of(run)
    full = simulate(profile, Layout.from_config(config), requests, SimOptions.from_config(config))
    result = SimResult(full.layout, [s for s, m in zip(full.seqs, measured) if m], full.step_ends)
    return [summarize(result, SLO(_s(row["ttft_ms"]), _s(row["tpot_ms"])), with_itl=False).goodput_rps for row in grid]


def _s(ms):
    return None if ms is None else ms / 1e3


def _calibrated(base: EngineProfile, entry: dict) -> EngineProfile | None:
    cal = entry.get("calibration")
    if not cal:
        return None
    return replace(base, cost=LinearCost.from_json(cal["cost"]))


def main(path: str, profile_path: str | None = None) -> None:
    data = json.loads(Path(path).read_text())
    base = EngineProfile.load(profile_path or Path(path).with_name(Path(path).stem + "_profile.json"))
    grid = slo_grid(data)
    print(f"{path}: predicted goodput vs measured (relative error) at each SLO pair")
    for entry in data["runs"]:
        config = TandemConfig.model_validate(entry["config"])
        run = measured_runs(entry)[-1]
        measured = [good_count(run, row["ttft_ms"], row["tpot_ms"]) / run["duration_s"] for row in grid]
        profiles = [("in-process profile", base)] + ([("calibrated", c)] if (c := _calibrated(base, entry)) else [])
        for name, profile in profiles:
            predicted = predicted_grid(profile, config, run, grid)
            errors = [(p - m) / m if m else None for p, m in zip(predicted, measured)]
            worst = max((abs(e) for e in errors if e is not None), default=None)
            print(f"  {entry['layout']:<6} {name:<19} worst {'-' if worst is None else f'{worst:.0%}'}: " + ", ".join(
                f"{row['ttft_ms'] / 1e3:g}s/{row['tpot_ms']:g}ms {p:.3f} vs {m:.3f}"
                + ("" if e is None else f" ({e:+.0%})") for row, p, m, e in zip(grid, predicted, measured, errors)))


if __name__ == "__main__":
    main(*sys.argv[1:])
