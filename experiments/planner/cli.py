"""`tandem plan` (simulate and search pool layouts) and `tandem plan profile` (measure this machine)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from experiments.loadgen.spec import LengthDist
from experiments.capacity.metrics import SLO
from cluster.control.autoscale.profile import EngineLimits, EngineProfile
from experiments.planner.report import print_table, result_json
from experiments.capacity.roofline import GPUS, MODEL_PRESETS, model_shape, roofline_profile
from experiments.capacity.search import recommend, search
from experiments.capacity.simulator import SimOptions
from experiments.planner.workload import synthetic_workload


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.allow_abbrev = False  # else `plan profile --model` reads as an ambiguous --model-preset/--model-config
    src = p.add_argument_group("costs (one of --profile or --gpu)")
    src.add_argument("--profile", default=None, help="profile JSON from `tandem plan profile` (or hand-written)")
    src.add_argument("--gpu", default=None, choices=sorted(GPUS), help="roofline profile for this GPU")
    src.add_argument("--model-preset", default=None, choices=sorted(MODEL_PRESETS), help="roofline: model size")
    src.add_argument("--model-config", default=None, help="roofline: a Hugging Face checkpoint dir or config.json")
    src.add_argument("--tensor-parallel", default="1",
                     help="roofline: GPUs per worker; several (e.g. 2,4,8) searches each pool at each size")
    src.add_argument("--mfu", type=float, default=0.5, help="roofline: fraction of peak FLOP/s reached")
    src.add_argument("--mbu", type=float, default=0.7, help="roofline: fraction of peak HBM bandwidth reached")
    wl = p.add_argument_group("workload")
    wl.add_argument("--prompt-len", default="512", help="N, uniform:LOW:HIGH or lognormal:MEAN:STD (tokens)")
    wl.add_argument("--output-len", default="128", help="N, uniform:LOW:HIGH or lognormal:MEAN:STD (tokens)")
    wl.add_argument("--arrival", default="poisson", choices=["poisson", "gamma"])
    wl.add_argument("--burstiness", type=float, default=1.0, help="gamma shape: 1 is Poisson, < 1 burstier")
    wl.add_argument("--num-requests", type=int, default=400, help="simulated requests per rate")
    wl.add_argument("--seed", type=int, default=0)
    slo = p.add_argument_group("objectives")
    slo.add_argument("--slo-ttft-ms", type=float, default=None, help="TTFT SLO (ms)")
    slo.add_argument("--slo-tpot-ms", type=float, default=None, help="TPOT SLO (ms)")
    slo.add_argument("--attainment", type=float, default=0.9, help="fraction of requests that must meet both SLOs")
    lay = p.add_argument_group("layouts")
    lay.add_argument("--max-workers", type=int, default=4, help="largest layout searched")
    lay.add_argument("--mode", default="both", choices=["disaggregated", "colocated", "both"])
    lay.add_argument("--target-rate", type=float, default=None, help="recommend the smallest layout sustaining this rate")
    lay.add_argument("--no-local-prefill", action="store_true", help="decode workers never prefill (scheduler.local_prefill: false)")
    lay.add_argument("--routing", default="cache_aware", choices=["cache_aware", "least_loaded", "round_robin"])
    p.add_argument("--out", default=None, help="write the whole search as JSON here")
    # Smoke mode (TANDEM_SMOKE=1): a short trace per rate, layouts of up to 2 workers.
    p.set_defaults(func=_plan, smoke={"num_requests": 50, "max_workers": 2})

    sub = p.add_subparsers(dest="plan_command")
    prof = sub.add_parser("profile", help="time the real engine on this machine and write a profile JSON")
    prof.add_argument("--model", default=None, help="checkpoint directory, 'builtin:tiny-llama' (default) or 'bench-llama-56m'")
    prof.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    prof.add_argument("--threads", type=int, default=1, help="torch threads, as the workers run (pool torch_threads)")
    prof.add_argument("--block-size", type=int, default=16)
    prof.add_argument("--num-kv-blocks", type=int, default=4096)
    prof.add_argument("--max-num-seqs", type=int, default=64)
    prof.add_argument("--max-num-batched-tokens", type=int, default=2048)
    prof.add_argument("--transfer-gbps", type=float, default=None,
                      help="KV transfer GB/s to record instead of measuring zmq ipc here")
    prof.add_argument("--repeats", type=int, default=5, help="timings per step shape (the median is kept)")
    prof.add_argument("--from-server", default=None, metavar="URL",
                      help="fit the step cost on a running server's workers (GET /admin/steps, timed end to end) "
                           "instead of timing an engine here; model, limits and transfer come from --base")
    prof.add_argument("--base", default=None, help="with --from-server: the profile JSON to refit")
    prof.add_argument("--role", default=None, choices=["prefill", "decode", "colocated"],
                      help="with --from-server: fit on this pool's workers only")
    prof.add_argument("--admin-key", default=None, help="with --from-server: ingress.admin_key, if set (default: the key a local server generated, ~/.cache/tandem/admin_key)")
    prof.add_argument("--out", required=True, help="profile JSON to write")
    prof.set_defaults(func=_profile, smoke={"model": "builtin:tiny-llama", "repeats": 1})


def _profile(args: argparse.Namespace) -> int:
    if args.from_server or args.base:
        return _profile_from_server(args)
    from actors.engine.model.default_model import resolve_model
    from experiments.bench_engine import ensure_bench_model
    from experiments.planner.measure import profile_engine

    model = str(ensure_bench_model()) if args.model == "bench-llama-56m" else resolve_model(args.model)
    if not Path(model).is_dir():
        raise ValueError(f"--model {args.model!r} is not a checkpoint directory")
    limits = EngineLimits(args.block_size, args.num_kv_blocks, args.max_num_seqs, args.max_num_batched_tokens)
    print(f"profiling {model} ({args.threads} thread(s), {args.dtype})")
    measure = args.transfer_gbps is None
    profile = profile_engine(model, args.dtype, args.threads, limits, repeats=args.repeats, measure_link=measure,
                             transfer_bytes_per_s=(args.transfer_gbps or 2.0) * 1e9)
    profile.save(args.out)
    print(f"profile written to {args.out}")
    return 0


def _profile_from_server(args: argparse.Namespace) -> int:
    if not (args.from_server and args.base):
        raise ValueError("--from-server URL and --base PROFILE go together")
    from experiments.planner.from_server import profile_from_server

    profile = profile_from_server(args.from_server, EngineProfile.load(args.base), args.admin_key, args.role)
    profile.save(args.out)
    print(f"{profile.hardware}\n{profile.samples[0]['fitted_on']}\nprofile written to {args.out}")
    return 0


def load_costs(args: argparse.Namespace) -> dict[int, EngineProfile]:
    """The costs of a worker of each tensor-parallel size searched (a measured profile: one process)."""
    if (args.profile is None) == (args.gpu is None):
        raise ValueError("give either --profile FILE or --gpu NAME with --model-preset/--model-config")
    if args.profile is not None:
        return {1: EngineProfile.load(args.profile)}
    try:
        sizes = sorted({int(x) for x in str(args.tensor_parallel).split(",")})
    except ValueError:
        raise ValueError(f"--tensor-parallel takes sizes like 4 or 2,4,8, got {args.tensor_parallel!r}") from None
    model = model_shape(args.model_preset, args.model_config)
    profiles, unfit = {}, []
    for tp in sizes:
        try:
            profiles[tp] = roofline_profile(args.gpu, model, tp, args.mfu, args.mbu)
        except ValueError as exc:
            if "does not fit" not in str(exc):
                raise
            unfit.append(tp)
    if not profiles:
        raise ValueError(f"{model.name} does not fit on {', '.join(map(str, unfit))} x {args.gpu}: raise --tensor-parallel")
    if unfit:
        print(f"tensor_parallel {', '.join(map(str, unfit))}: {model.name} does not fit; not searched")
    return profiles


def _plan(args: argparse.Namespace) -> int:
    profile = load_costs(args)
    if args.slo_ttft_ms is None and args.slo_tpot_ms is None:
        raise ValueError("give at least one SLO: --slo-ttft-ms and/or --slo-tpot-ms")
    if not 0 < args.attainment <= 1:
        raise ValueError(f"--attainment must be in (0, 1], got {args.attainment}")
    slo = SLO(None if args.slo_ttft_ms is None else args.slo_ttft_ms / 1e3,
              None if args.slo_tpot_ms is None else args.slo_tpot_ms / 1e3)
    prompt, output = LengthDist.parse(args.prompt_len), LengthDist.parse(args.output_len)
    workload = synthetic_workload(args.num_requests, prompt, output, args.arrival, args.burstiness, args.seed)
    options = SimOptions(routing=args.routing, local_prefill=not args.no_local_prefill)
    for p in profile.values():
        print(f"profile: {p.source} on {p.hardware}, model {p.model.name}, KV {p.kv_bytes_per_token} bytes a token")
    print(f"workload: {args.num_requests} requests, prompt {prompt.describe()}, output {output.describe()}, "
          f"{args.arrival} arrivals; SLO TTFT {args.slo_ttft_ms} ms, TPOT {args.slo_tpot_ms} ms, "
          f"attainment >= {args.attainment:.0%}")
    rows = search(profile, workload, slo, args.max_workers, args.mode, options, args.attainment)
    print_table(rows)
    rec = recommend(rows, args.target_rate)
    print(f"\nrecommended: {rec.layout.describe()} ({rec.why}; predicted max rate {rec.expected_max_rate_rps:.3g} req/s)")
    print("config snippet:\n" + rec.yaml())
    if args.out:
        Path(args.out).write_text(json.dumps(result_json(profile, args, rows, rec), indent=2) + "\n")
        print(f"search written to {args.out}")
    return 0
