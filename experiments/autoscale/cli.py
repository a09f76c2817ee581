"""`tandem bench autoscale`: a time-varying trace against the best static layout and the SLO autoscaler.

    tandem bench autoscale --gpu h100 --model-preset llama3-8b --budget 16 --rate 40 --out results/autoscale/run.json

Both see the same trace (seed) and the same budget of workers; the report gives each one's goodput (requests
within both SLOs per second of trace), SLO attainment per phase and per interval, machine-seconds, the
autoscaler's decisions, and how many intervals attainment took to get back above 90% after each phase
change. A PNG timeline beside the JSON shows pool sizes and attainment per interval.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from cluster.control.autoscale.load_policy import Bounds
from cluster.control.autoscale.slo_policy import Forecast, PoolModel, SloPolicy, SloTargets
from experiments.capacity.metrics import SLO
from cluster.control.autoscale.profile import EngineProfile
from experiments.capacity.roofline import GPUS, MODEL_PRESETS, roofline_profile
from experiments.capacity.simulator import Layout, SimOptions
from cluster.control.config import LOCAL_PREFILL_OVERFLOW_S
from experiments.autoscale.runs import Outcome, SloController, autoscaled, best_static
from experiments.autoscale.trace import draw, four_phases, phase_bounds


def add_arguments(p: argparse.ArgumentParser) -> None:
    src = p.add_argument_group("costs (one of --profile or --gpu)")
    src.add_argument("--profile", default=None, help="profile JSON from `tandem plan profile`")
    src.add_argument("--gpu", default="h100", choices=sorted(GPUS), help="roofline profile for this GPU")
    src.add_argument("--model-preset", default="llama3-8b", choices=sorted(MODEL_PRESETS))
    p.add_argument("--budget", type=int, default=16, help="workers: the static layout's size, the autoscaler's most")
    p.add_argument("--rate", type=float, default=40.0, help="requests/s of the prompt- and decode-heavy phases")
    p.add_argument("--phase-s", type=float, default=150.0, help="seconds per phase (four phases)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--slo-ttft-ms", type=float, default=500.0)
    p.add_argument("--slo-tpot-ms", type=float, default=20.0)
    p.add_argument("--percentile", type=float, default=90.0, help="the SLO's percentile")
    p.add_argument("--interval-s", type=float, default=10.0, help="autoscaler.interval_s (shipped: 10)")
    p.add_argument("--react-s", type=float, default=2.0,
                   help="autoscaler.slo.react_s (shipped: 2): between decisions, check this often whether a pool must grow now (0: off)")
    p.add_argument("--overlap-resizes", action="store_true",
                   help="let the autoscaler decide again while a resize's flips are still under way (the product waits for them)")
    p.add_argument("--start-s", type=float, default=60.0, help="a new worker's start to serving (process + weights)")
    p.add_argument("--flip-s", type=float, default=None,
                   help="also run the autoscaler with role flips taking this long after a drain (simulated only)")
    p.add_argument("--static", default=None, metavar="P:D[,P:D...]",
                   help="compare against the best of these static layouts instead of searching every split of the budget")
    p.add_argument("--forecast", default="trend", choices=["constant", "trend"])
    p.add_argument("--headroom", type=float, default=0.0,
                   help="autoscaler.slo.headroom: size for this fraction more than the forecast (shipped: 0)")
    p.add_argument("--min-replicas", default="1:1", metavar="P:D",
                   help="prefill.min_replicas:decode.min_replicas, the fewest workers the autoscaler keeps in each "
                        "pool: capacity kept warm for a phase that cold starts would reach too late (shipped: 1:1)")
    p.add_argument("--no-local-prefill", action="store_true",
                   help="decode workers never prefill (scheduler.local_prefill: false); on by default, as shipped")
    p.add_argument("--local-prefill-overflow-s", type=float, default=LOCAL_PREFILL_OVERFLOW_S, metavar="S",
                   help="scheduler.local_prefill_overflow_s: decode workers take prompts of any length once the best "
                   "prefill worker is predicted to take longer than this to a first token; 0: never "
                   f"(shipped: {LOCAL_PREFILL_OVERFLOW_S:g})")
    p.add_argument("--start", default="static", choices=["static", "small"],
                   help="the autoscaler's first layout: the best static one, or the pools' minimums (--min-replicas)")
    p.add_argument("--out", default=None, help="the report's JSON; the PNG timeline goes beside it")
    p.set_defaults(func=main, smoke={"budget": 4, "rate": 4.0, "phase_s": 40.0, "interval_s": 10.0})


def main(args: argparse.Namespace) -> int:
    profile = (EngineProfile.load(args.profile) if args.profile else
               roofline_profile(args.gpu, MODEL_PRESETS[args.model_preset]))
    if args.budget < 2:
        raise ValueError(f"--budget must be >= 2 (one prefill and one decode worker), got {args.budget}")
    phases = four_phases(args.rate, args.phase_s)
    requests = draw(phases, args.seed)
    duration = sum(p.duration_s for p in phases)
    slo = SLO(args.slo_ttft_ms / 1000, args.slo_tpot_ms / 1000)
    print(f"trace: {len(requests)} requests over {duration:.0f} s, "
          + ", ".join(f"{p.name} {p.rate:g}/s {p.prompt_tokens:.0f} in {p.output_tokens:.0f} out" for p in phases))

    t0 = time.monotonic()
    splits = None if args.static is None else [_split(one, args.budget) for one in args.static.split(",")]
    options = SimOptions(local_prefill=not args.no_local_prefill,
                         local_prefill_overflow_s=args.local_prefill_overflow_s or None)
    static, tried = best_static(profile, requests, slo, args.budget, duration, splits, options)
    print(f"static layout of {args.budget}: {static.layout} (best of {len(tried)} splits simulated, "
          f"{time.monotonic() - t0:.0f} s)")
    least_prefill, least_decode = _floors(args.min_replicas, args.budget)
    runs = [static]
    for flip_s in (None, args.flip_s) if args.flip_s is not None else (None,):
        policy = SloPolicy(PoolModel(profile), SloTargets(slo.ttft_s, slo.tpot_s), args.interval_s,
                           Forecast(args.forecast), headroom=args.headroom, flips=flip_s is not None)
        bounds = {"prefill": Bounds(least_prefill, args.budget - 1), "decode": Bounds(least_decode, args.budget - 1)}
        controller = SloController(policy, bounds, args.budget, args.percentile, args.react_s or None)
        name = "autoscaler" if flip_s is None else f"autoscaler+flips({flip_s:g}s)"
        first = Layout.disaggregated(least_prefill, least_decode) if args.start == "small" else Layout.disaggregated(
            static.timeline[0][1]["prefill"], static.timeline[0][1]["decode"])
        runs.append(autoscaled(profile, requests, slo, controller, first, args.start_s, flip_s, duration, name,
                               options, blocking=not args.overlap_resizes))
    report = _report(args, profile, phases, requests, duration, runs, tried)
    _print(report)
    out = Path(args.out) if args.out else None
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=1))
        from experiments.autoscale.plots import timeline_png

        timeline_png(report, out.with_suffix(".png"))
    scaled = report["runs"][1]
    print(f"tandem bench autoscale: goodput {scaled['goodput_vs_static']:.2f}x the static {report['runs'][0]['layout']} "
          f"at {scaled['machine_s_vs_static']:.2f}x its machine-seconds"
          + (f"; wrote {out} and {out.with_suffix('.png')}" if out else ""))
    return 0


def _pair(text: str, flag: str) -> tuple[int, int]:
    try:
        prefill, decode = (int(x) for x in text.split(":"))
    except ValueError:
        raise ValueError(f"{flag} must be P:D, e.g. 6:10; got {text!r}") from None
    return prefill, decode


def _split(text: str, budget: int) -> int:
    prefill, decode = _pair(text, "--static")
    if prefill < 1 or decode < 1 or prefill + decode != budget:
        raise ValueError(f"--static {text}: needs >= 1 of each pool and P + D = --budget ({budget})")
    return prefill


def _floors(text: str, budget: int) -> tuple[int, int]:
    prefill, decode = _pair(text, "--min-replicas")
    if prefill < 1 or decode < 1 or prefill + decode > budget:
        raise ValueError(f"--min-replicas {text}: needs >= 1 of each pool and P + D <= --budget ({budget})")
    return prefill, decode


def _report(args, profile, phases, requests, duration, runs: list[Outcome], tried) -> dict:
    bounds = phase_bounds(phases)
    arrivals = [r.arrival_s for r in requests]

    def share(good, lo, hi) -> float | None:
        picked = [g for g, t in zip(good, arrivals) if lo <= t < hi]
        return sum(picked) / len(picked) if picked else None

    intervals = [(t, t + args.interval_s) for t in _range(0.0, duration, args.interval_s)]
    out = []
    for run in runs:
        per_interval = [share(run.good, lo, hi) for lo, hi in intervals]
        out.append({
            "name": run.name, "layout": run.layout, "goodput_rps": sum(run.good) / duration,
            "attainment": sum(run.good) / len(run.good), "machine_s": run.machine_s, "flips": run.flips,
            "attainment_per_phase": {name: share(run.good, lo, hi) for name, lo, hi in bounds},
            "attainment_per_interval": per_interval,
            "intervals_to_recover": _recovery(bounds, intervals, per_interval),
            "timeline": [[t, sizes] for t, sizes in run.timeline], "decisions": run.decisions,
        })
    static = out[0]
    for run in out[1:]:
        run["goodput_vs_static"] = run["goodput_rps"] / static["goodput_rps"] if static["goodput_rps"] else None
        run["machine_s_vs_static"] = run["machine_s"] / static["machine_s"]
    return {
        "model": "capacity simulator (experiments/capacity), costs " + profile.source + ": " + profile.hardware,
        "args": {k: v for k, v in vars(args).items() if k not in ("func", "smoke")},
        "slo": {"ttft_s": args.slo_ttft_ms / 1000, "tpot_s": args.slo_tpot_ms / 1000, "percentile": args.percentile},
        "phases": [{"name": n, "start_s": lo, "end_s": hi} for n, lo, hi in bounds],
        "requests": len(requests), "duration_s": duration, "static_splits": tried, "runs": out,
    }


def _recovery(bounds, intervals, per_interval) -> dict[str, int | None]:
    """Per phase change: intervals from the change until attainment (of requests arriving in an interval)
    is >= 90% and stays so to the end of the phase (a later dip counts: the phase had not recovered); 0 if
    every interval of the phase is, None if its last one is not."""
    out = {}
    for name, lo, hi in bounds[1:]:
        inside = [a for (s, _), a in zip(intervals, per_interval) if lo <= s < hi]
        out[name] = next((i for i in range(len(inside)) if all(a is None or a >= 0.9 for a in inside[i:])), None)
    return out


def _range(start: float, stop: float, step: float):
    t = start
    while t < stop - 1e-9:
        yield t
        t += step


def _print(report: dict) -> None:
    print(f"{'run':<26}{'goodput/s':>10}{'attain':>8}{'machine-s':>11}  per phase")
    for run in report["runs"]:
        phases = " ".join(f"{k} {v:.0%}" if v is not None else f"{k} -" for k, v in run["attainment_per_phase"].items())
        print(f"{run['name']:<26}{run['goodput_rps']:>10.2f}{run['attainment']:>8.1%}{run['machine_s']:>11.0f}  {phases}")
    for run in report["runs"][1:]:
        print(f"{run['name']}: goodput {run['goodput_vs_static']:.2f}x the static layout's at "
              f"{run['machine_s_vs_static']:.2f}x its machine-seconds; {len([d for d in run['decisions'] if d['changes']])} "
              f"resizes, {run['flips']} flips; intervals to >= 90% after each phase change: {run['intervals_to_recover']}")
