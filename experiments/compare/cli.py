"""`tandem bench compare`: the same trace against several layouts of equal resources, each started here."""

from __future__ import annotations

import argparse
from pathlib import Path

from cluster.control.config import EngineSection, TandemConfig
from experiments.bench_report import add_out_argument, out_path, summary_line, write_json
from experiments.compare.layouts import DEFAULT_LAYOUTS, WorkerResources, parse_layouts
from experiments.compare.model import COMPARE_MODEL, resolve_compare_model
from experiments.compare.report import format_compare, headline
from experiments.compare.rescore import format_grid, slo_grid
from experiments.compare.run import ComparePlan, run_compare
from experiments.loadgen.cli import SMOKE_LOAD, add_load_arguments, rates_from_args, spec_from_args
from cluster.control.autoscale.profile import EngineLimits, EngineProfile

# Without --config: chunked prefill in 512-token chunks (what a colocated worker needs to keep decoding
# during long prompts) and a KV cache of 2048 blocks per worker (0.8 GB for the compare model).
DEFAULT_ENGINE = EngineSection(num_kv_blocks=2048, max_num_batched_tokens=512)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.description = ("Start each layout (`tandem serve` in a subprocess), send it the same open-loop trace, stop it, "
                     "and compare goodput, SLO attainment and p99 ITL; optionally next to the planner's prediction.")
    lay = p.add_argument_group("layouts")
    lay.add_argument("--layouts", default=DEFAULT_LAYOUTS,
                     help="comma-separated, each 'NC' (colocated) or 'xP:yD', all with the same worker count; "
                          "the first is the baseline of the ratios (default: %(default)s; e.g. 4C,1P:3D,2P:2D,3P:1D)")
    lay.add_argument("--model", default=COMPARE_MODEL,
                     help=f"checkpoint directory, or {COMPARE_MODEL!r} (default: a ~100M random Llama built here)")
    lay.add_argument("--config", default=None,
                     help="base YAML whose engine/scheduler/transfer sections every layout uses (default: "
                          "chunks of 512 tokens, 2048 KV blocks per worker)")
    lay.add_argument("--cpus-per-worker", type=float, default=1.0, help="Ray CPUs of every worker (default: 1)")
    lay.add_argument("--threads-per-worker", type=int, default=1, help="torch threads of every worker (default: 1)")
    lay.add_argument("--local-prefill", action="store_true",
                     help="let decode workers prefill when predicted faster (default: off, pure disaggregation)")
    lay.add_argument("--cooldown", type=float, default=5.0, help="idle seconds between layouts (default: 5)")
    lay.add_argument("--start-timeout", type=float, default=300.0, help="seconds a layout may take to become ready")
    add_load_arguments(p)
    sim = p.add_argument_group("planner validation")
    sim.add_argument("--profile", default=None, help="engine profile JSON: predict each run with the simulator")
    sim.add_argument("--measure-profile", action="store_true",
                     help="profile the engine here first (`tandem plan profile`), saved next to the result")
    sim.add_argument("--calibrate-s", type=float, default=None,
                     help="with a profile: send each layout this many seconds of the same workload (other seeds) "
                          "first, and also predict its run with the profile refitted on its workers' steps")
    sim.add_argument("--profile-repeats", type=int, default=5, help="timings per profiled step shape (median)")
    o = p.add_argument_group("output")
    add_out_argument(o, "compare", "PNGs and the layouts' configs and server logs go beside it")
    o.add_argument("--no-plots", action="store_true")
    o.add_argument("--no-progress", action="store_true")
    # Smoke mode (TANDEM_SMOKE=1): the tiny model, no pause between layouts, the load generator's toy load.
    p.set_defaults(func=run, base_url="http://unused", api_key=None, served_model=None,
                   smoke={**SMOKE_LOAD, "model": "builtin:tiny-llama", "cooldown": 0.0, "profile_repeats": 1})


def _base_config(path: str | None) -> TandemConfig:
    return TandemConfig.from_file(path) if path else TandemConfig(engine=DEFAULT_ENGINE)


def _profile(args: argparse.Namespace, base: TandemConfig, model: str, out: Path) -> EngineProfile | None:
    if args.profile and args.measure_profile:
        raise ValueError("give --profile FILE or --measure-profile, not both")
    if args.profile:
        return EngineProfile.load(args.profile)
    if not args.measure_profile:
        return None
    from experiments.planner.measure import profile_engine

    limits = EngineLimits.from_config(base)
    print(f"profiling {model} ({args.threads_per_worker} thread(s)) for the planner")
    profile = profile_engine(model, base.model.dtype, args.threads_per_worker, limits, repeats=args.profile_repeats)
    path = out.parent / f"{out.stem}_profile.json"
    profile.save(path)
    print(f"profile written to {path}")
    return profile


def plan_from_args(args: argparse.Namespace, out: Path) -> ComparePlan:
    layouts = parse_layouts(args.layouts)
    bench = spec_from_args(argparse.Namespace(**{**vars(args), "model": None}))
    if bench.arrival.kind == "closed":
        raise ValueError("compare sends one open-loop trace to every layout: drop --concurrency")
    base = _base_config(args.config)
    if base.engine.num_kv_blocks is None and (args.profile or args.measure_profile):
        raise ValueError("planner validation needs engine.num_kv_blocks set in --config")
    model = resolve_compare_model(args.model)
    rates = rates_from_args(args)
    sweep_kwargs = None
    if args.sweep and not rates:
        sweep_kwargs = {"factor": args.sweep_factor, "max_steps": args.sweep_steps, "refine": args.sweep_refine,
                        "target": args.target_attainment}
    return ComparePlan(bench=bench, layouts=layouts, base_config=base, model_path=model,
                       resources=WorkerResources(args.cpus_per_worker, args.threads_per_worker),
                       local_prefill=args.local_prefill, rates=rates, sweep_kwargs=sweep_kwargs,
                       profile=_profile(args, base, model, out), calibrate_s=args.calibrate_s,
                       cooldown_s=args.cooldown,
                       start_timeout_s=args.start_timeout, workdir=out.parent)


def run(args: argparse.Namespace) -> int:
    out = out_path("compare", args.out)
    data = run_compare(plan_from_args(args, out))
    data["slo_sensitivity"] = slo_grid(data)
    write_json(out, data)
    print(format_compare(data))
    print(format_grid(data["slo_sensitivity"]))
    plots = []
    if not args.no_plots:
        from experiments.compare.plots import write_compare_plots  # matplotlib loads only when plotting

        plots = write_compare_plots(data, out)
    print(summary_line("compare", summarize(data), out, plots), flush=True)
    return 0


def summarize(data: dict) -> str:
    """Each layout's goodput and SLO attainment at each rate, the first layout's being the baseline."""
    def at(rate: float | None) -> str:
        return "the trace's rate" if rate is None else f"{rate:.3g} req/s"

    return "; ".join(f"{r['layout']} at {at(r['rate_rps'])}: goodput {r['goodput_rps']:.2f} req/s, "
                     f"attainment {100 * r['attainment']:.0f}%" for r in headline(data))
