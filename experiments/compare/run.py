"""Run one workload against several layouts, one after another, each started and stopped here.

Every layout gets the same `BenchSpec` with the same prompt salt, so the same requests (arrival
times, prompt tokens, output lengths) reach each of them; only the server's URL differs. A layout is
fully stopped (process gone, port free, no daemon left in its session) before the next one starts.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from cluster.control.config import TandemConfig
from experiments.compare.layouts import WorkerResources, layout_config, write_config
from experiments.compare.machine import load_average, machine_info
from experiments.compare.predict import predict, validation
from experiments.compare.server import ServeProcess, free_port
from experiments.loadgen.runner import run_benchmark
from experiments.planner.from_server import fetch_steps
from experiments.loadgen.spec import BenchSpec
from experiments.loadgen.sweep import sweep
from cluster.control.autoscale.fit import refit
from cluster.control.autoscale.profile import EngineProfile
from experiments.capacity.simulator import Layout


@dataclass
class ComparePlan:
    bench: BenchSpec  # its base_url is replaced by each layout's server
    layouts: list[Layout]
    base_config: TandemConfig
    model_path: str
    resources: WorkerResources = WorkerResources()
    local_prefill: bool = False
    rates: list[float] | None = None  # a sweep over these rates (same at every layout)
    sweep_kwargs: dict | None = None  # an adaptive sweep from bench.arrival.rate (rates may differ per layout)
    profile: EngineProfile | None = None
    # Seconds of calibration traffic (the same workload, other seeds) sent to each layout before its run:
    # the profile refitted on the workers' own steps (GET /admin/steps) predicts the run beside the profile.
    calibrate_s: float | None = None
    host: str = "127.0.0.1"
    cooldown_s: float = 5.0  # idle time between layouts, so one's tail does not land in the next one's load
    start_timeout_s: float = 300.0
    workdir: Path = field(default_factory=lambda: Path("."))


def run_compare(plan: ComparePlan, log: Callable[[str], None] = print) -> dict:
    bench = plan.bench.with_fixed_salt()
    plan.workdir.mkdir(parents=True, exist_ok=True)
    out = {"compare": True, "spec": bench.model_dump(mode="json"), "layouts": [lay.describe() for lay in plan.layouts],
           "model": plan.model_path, "resources_per_worker": vars(plan.resources),
           "local_prefill": plan.local_prefill, "machine": {**machine_info(), "load_avg_start": load_average()},
           "profile": None if plan.profile is None else _profile_summary(plan.profile), "runs": []}
    for i, layout in enumerate(plan.layouts):
        if i:
            time.sleep(plan.cooldown_s)
        out["runs"].append(_run_layout(plan, bench, layout, log))
    out["machine"]["load_avg_end"] = load_average()
    return out


def _run_layout(plan: ComparePlan, bench: BenchSpec, layout: Layout, log) -> dict:
    name = layout.describe()
    config = layout_config(plan.base_config, layout, plan.model_path, plan.resources, plan.local_prefill)
    config_path = write_config(config, plan.workdir / f"layout-{name.replace(':', '')}.yaml")
    server = ServeProcess(config_path, plan.host, free_port(plan.host), config_path.with_suffix(".log"),
                          layout.num_workers)
    entry = {"layout": name, "config": config.model_dump(mode="json"), "load_avg_before": load_average()}
    log(f"{name}: starting tandem serve on port {server.port} (log {server.log_path})")
    started = time.monotonic()
    try:
        server.start(plan.start_timeout_s)
        entry["startup_s"] = time.monotonic() - started
        calibrated = None
        if plan.calibrate_s and plan.profile is not None:
            log(f"{name}: ready after {entry['startup_s']:.0f} s; {plan.calibrate_s:g} s of calibration traffic")
            calibrated, entry["calibration"] = _calibrate(plan, bench, server.url, name)
        log(f"{name}: ready after {entry['startup_s']:.0f} s; sending the workload")
        spec = bench.model_copy(update={"base_url": server.url})
        if plan.rates or plan.sweep_kwargs is not None:
            result = sweep(spec, plan.rates, **(plan.sweep_kwargs or {}))
        else:
            result = run_benchmark(spec)
        entry["load_avg_after"] = load_average()
    finally:
        entry["server"] = server.stop()
        log(f"{name}: stopped (exit {entry['server']['returncode']}, port free {entry['server']['port_free']}, "
            f"leftover processes killed: {len(entry['server']['leftover_pids'])})")
    entry["result"] = result.to_dict()
    if plan.profile is not None:
        for run in _runs(entry["result"]):
            run["prediction"] = predict(plan.profile, config, run)
            run["validation"] = validation(run["prediction"], run)
            if calibrated is not None:
                run["prediction_calibrated"] = predict(calibrated, config, run)
                run["validation_calibrated"] = validation(run["prediction_calibrated"], run)
    return entry


def _calibrate(plan: ComparePlan, bench: BenchSpec, url: str, name: str) -> tuple[EngineProfile, dict]:
    """Send the layout other requests of the same workload (other seeds and prompts), then refit the profile
    on its workers' steps; the measured run that follows is predicted with it."""
    salt = (bench.workload.prompt_salt or 0) + 1
    spec = bench.model_copy(update={
        "base_url": url, "duration_s": plan.calibrate_s, "num_requests": None, "warmup": 0, "progress": False,
        "workload": bench.workload.model_copy(update={"seed": bench.workload.seed + 1000, "prompt_salt": salt}),
        "arrival": bench.arrival.model_copy(update={"seed": bench.arrival.seed + 1000})})
    result = run_benchmark(spec).to_dict()
    profile = refit(plan.profile, fetch_steps(url), f"{name} after {plan.calibrate_s:g} s of calibration traffic")
    return profile, {"duration_s": plan.calibrate_s, "requests": len(result["requests"]),
                     "fitted_on": profile.samples[0]["fitted_on"], "cost": profile.cost.to_json()}


def _runs(result: dict) -> list[dict]:
    return result["runs"] if result.get("sweep") else [result]


def _profile_summary(profile: EngineProfile) -> dict:
    data = profile.to_json()
    data.pop("samples", None)
    return data
