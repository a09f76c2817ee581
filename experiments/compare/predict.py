"""The planner's prediction for a layout on the exact trace a compare sent, next to what was measured.

The simulator gets every request of the run (warm-up included, since it loads the server too) at its
scheduled arrival with its prompt length and max_tokens, and the layout's own engine limits and
routing options; goodput and latencies are then summarized over the measured requests only, with the
load generator's definitions (good / (last measured finish - first measured arrival)).
"""

from __future__ import annotations

from dataclasses import replace

from cluster.control.config import TandemConfig
from experiments.capacity.metrics import SLO, summarize
from cluster.control.autoscale.profile import EngineLimits, EngineProfile
from experiments.capacity.simulator import Layout, SimOptions, SimResult, simulate
from experiments.capacity.workload import SimRequest


def requests_of(run: dict) -> tuple[list[SimRequest], list[bool]]:
    """The run's requests as the simulator takes them, and which of them were measured."""
    reqs = sorted(run["requests"], key=lambda r: r["index"])
    return ([SimRequest(r["scheduled_s"], r["prompt_len"], r["max_tokens"]) for r in reqs],
            [not r["warmup"] for r in reqs])


def predict(profile: EngineProfile, config: TandemConfig, run: dict) -> dict:
    profile = replace(profile, engine=EngineLimits.from_config(config))
    requests, measured = requests_of(run)
    full = simulate(profile, Layout.from_config(config), requests, SimOptions.from_config(config))
    result = SimResult(full.layout, [s for s, m in zip(full.seqs, measured) if m], full.step_ends)
    slo = run["slo"]
    s = summarize(result, SLO(_s(slo["ttft_ms"]), _s(slo["tpot_ms"])))
    ms = lambda x: None if x is None else 1e3 * x  # noqa: E731
    return {"goodput_rps": s.goodput_rps, "attainment": s.attainment, "throughput_rps": s.throughput_rps,
            "ttft_p90_ms": ms(s.ttft.p90), "ttft_p99_ms": ms(s.ttft.p99), "tpot_p90_ms": ms(s.tpot.p90),
            "itl_p99_ms": ms(s.itl.p99), "rejected": s.rejected}


def _s(ms: float | None) -> float | None:
    return None if ms is None else ms / 1e3


def relative_error(predicted: float | None, measured: float | None) -> float | None:
    """(predicted - measured) / measured; None when either is missing or the measurement is 0."""
    if predicted is None or measured is None or measured == 0:
        return None
    return (predicted - measured) / measured


def validation(predicted: dict, run: dict) -> dict:
    """Predicted vs measured goodput and p90 TTFT (the planner's acceptance numbers), with errors."""
    measured = {"goodput_rps": run["slo"]["goodput_rps"], "ttft_p90_ms": run["latency_ms"]["ttft"]["p90"],
                "attainment": run["slo"]["attainment"], "itl_p99_ms": run["latency_ms"]["itl"]["p99"]}
    return {key: {"predicted": predicted.get(key), "measured": value,
                  "relative_error": relative_error(predicted.get(key), value)}
            for key, value in measured.items()}
