"""`tandem bench serve`: an open-loop load generator for any OpenAI-compatible completions endpoint."""

from __future__ import annotations

import argparse

from experiments.bench_report import add_out_argument, out_path, summary_line
from experiments.loadgen.report import format_run, format_sweep
from experiments.loadgen.runner import run_benchmark
from experiments.loadgen.server_wait import wait_for_server
from experiments.loadgen.spec import ArrivalSpec, BenchSpec, LengthDist, WorkloadSpec
from experiments.loadgen.sweep import DEFAULT_TARGET, sweep

# Smoke mode (TANDEM_SMOKE=1, see experiments/smoke.py): a few short requests for a few seconds.
SMOKE_LOAD = {"duration": 3.0, "num_requests": 6, "warmup": 1, "prompt_len": LengthDist.parse("uniform:16:64"),
              "output_len": LengthDist.parse("uniform:4:8"), "sweep_steps": 2, "sweep_refine": 0}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.description = ("Send a workload to an OpenAI-compatible server (streaming /v1/completions) on an open-loop "
                     "schedule; latency counts from each request's scheduled arrival.")
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="server root (default: %(default)s)")
    p.add_argument("--model", default=None, help="model name (default: the first one /v1/models lists)")
    p.add_argument("--api-key", default=None, help="bearer token")
    p.add_argument("--wait-server", type=float, default=300.0, metavar="S",
                   help="seconds to wait for the server to answer first, e.g. while `tandem serve` starts (default: %(default)s)")
    add_load_arguments(p)
    o = p.add_argument_group("output")
    add_out_argument(o, "serve", "PNGs go beside it")
    o.add_argument("--no-plots", action="store_true")
    o.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=run, smoke=SMOKE_LOAD)


def add_load_arguments(p: argparse.ArgumentParser) -> None:
    """What to send and when, and the SLOs: shared with `tandem bench compare`."""
    w = p.add_argument_group("workload")
    w.add_argument("--prompt-len", type=LengthDist.parse, default=LengthDist.parse("128"),
                   help="prompt tokens: N, uniform:LOW:HIGH or lognormal:MEAN:STD (shared prefix: the suffix)")
    w.add_argument("--output-len", type=LengthDist.parse, default=LengthDist.parse("32"),
                   help="output tokens, same forms (sent as max_tokens with ignore_eos)")
    w.add_argument("--vocab-size", type=int, default=2000, help="prompt token ids come from [10, V) (default: %(default)s)")
    w.add_argument("--shared-prefixes", type=int, default=None, metavar="K",
                   help="shared-prefix workload: K system prompts, each request one of them + a fresh suffix")
    w.add_argument("--prefix-len", type=int, default=256, help="tokens per shared system prompt (default: %(default)s)")
    w.add_argument("--trace", default=None, metavar="FILE",
                   help="JSONL trace: timestamp, prompt (text or token ids) or prompt_len, output_len")
    w.add_argument("--seed", type=int, default=0, help="seeds the workload lengths and the arrival draws")
    w.add_argument("--prompt-salt", type=int, default=None,
                   help="fixes prompt contents (default: fresh each run, so the server's prefix cache is cold)")
    a = p.add_argument_group("arrivals")
    a.add_argument("--arrival", choices=["poisson", "gamma", "constant", "trace"], default=None,
                   help="open-loop process (default: trace with --trace, gamma with --burstiness, else poisson)")
    a.add_argument("--rate", type=float, default=None, help="requests per second (sweep: the starting rate)")
    a.add_argument("--burstiness", type=float, default=None, help="gamma shape: 1 is Poisson, < 1 burstier")
    a.add_argument("--concurrency", type=int, default=None, help="closed loop instead: keep N requests in flight")
    a.add_argument("--num-requests", type=int, default=None, help="measured requests")
    a.add_argument("--duration", type=float, default=None, help="seconds of measured arrivals")
    a.add_argument("--warmup", type=int, default=0, help="requests sent first and reported apart")
    a.add_argument("--request-timeout", type=float, default=120.0, help="seconds from scheduled arrival")
    a.add_argument("--temperature", type=float, default=0.0)
    s = p.add_argument_group("SLOs and sweeps")
    s.add_argument("--slo-ttft-ms", type=float, default=None, help="a good request's TTFT is at most this")
    s.add_argument("--slo-tpot-ms", type=float, default=None, help="a good request's TPOT is at most this")
    s.add_argument("--sweep", action="store_true", help="raise the rate from --rate until attainment drops")
    s.add_argument("--rates", default=None, help="sweep exactly these rates, e.g. 0.5,1,2,4")
    s.add_argument("--sweep-factor", type=float, default=2.0, help="geometric step of the search")
    s.add_argument("--sweep-steps", type=int, default=8, help="at most this many rising rates")
    s.add_argument("--sweep-refine", type=int, default=2, help="bisections between the last passing and first failing rate")
    s.add_argument("--target-attainment", type=float, default=DEFAULT_TARGET)


def spec_from_args(args: argparse.Namespace) -> BenchSpec:
    if args.trace:
        kind = "trace"
    elif args.shared_prefixes is not None:
        kind = "shared_prefix"
    else:
        kind = "synthetic"
    workload = WorkloadSpec(kind=kind, prompt_len=args.prompt_len, output_len=args.output_len, vocab_size=args.vocab_size,
                            num_prefixes=args.shared_prefixes or 1, prefix_len=args.prefix_len, trace_path=args.trace,
                            seed=args.seed, prompt_salt=args.prompt_salt)
    if args.concurrency is not None:
        if args.arrival or args.rate is not None:
            raise ValueError("--concurrency runs a closed loop; it does not combine with --arrival or --rate")
        arrival = ArrivalSpec(kind="closed", concurrency=args.concurrency, seed=args.seed)
    else:
        kind = args.arrival or ("trace" if args.trace else "gamma" if args.burstiness is not None else "poisson")
        arrival = ArrivalSpec(kind=kind, rate=args.rate or _first_rate(args), burstiness=args.burstiness or 1.0,
                              seed=args.seed)
    return BenchSpec(base_url=args.base_url, model=args.model, api_key=args.api_key, workload=workload, arrival=arrival,
                     num_requests=args.num_requests, duration_s=args.duration, warmup=args.warmup,
                     slo_ttft_ms=args.slo_ttft_ms, slo_tpot_ms=args.slo_tpot_ms,
                     request_timeout_s=args.request_timeout, temperature=args.temperature,
                     progress=not args.no_progress)


def rates_from_args(args: argparse.Namespace) -> list[float] | None:
    if not args.rates:
        return None
    try:
        return [float(x) for x in args.rates.split(",")]
    except ValueError:
        raise ValueError(f"--rates wants numbers separated by commas, got {args.rates!r}") from None


def _first_rate(args: argparse.Namespace) -> float | None:
    rates = rates_from_args(args)
    return min(rates) if rates else None


def run(args: argparse.Namespace) -> int:
    spec = spec_from_args(args)
    out = out_path("serve", args.out)
    wait_for_server(spec.root_url, args.wait_server, {"Authorization": f"Bearer {args.api_key}"} if args.api_key else None)
    if args.sweep or args.rates:
        result = sweep(spec, rates_from_args(args), factor=args.sweep_factor, max_steps=args.sweep_steps,
                       refine=args.sweep_refine, target=args.target_attainment,
                       on_run=lambda r: print(f"rate {r.spec.arrival.rate:.3g} req/s: attainment "
                                              f"{100 * r.summary['slo']['attainment']:.1f}%", flush=True))
    else:
        result = run_benchmark(spec)
    result.save(out)
    data = result.to_dict()
    print(format_sweep(data) if data.get("sweep") else format_run(data))
    from experiments.loadgen.plots import write_plots  # matplotlib loads only when plotting

    plots = [] if args.no_plots else write_plots(data, out)
    print(summary_line("serve", summarize(data), out, plots), flush=True)
    return 0


def summarize(data: dict) -> str:
    if data.get("sweep"):
        best = data["best_rate"]
        return (f"{len(data['runs'])} rates tried; highest with >= {100 * data['target']:.0f}% SLO attainment: "
                + ("none" if best is None else f"{best:.3g} req/s"))
    c, lat, slo = data["counts"], data["latency_ms"], data["slo"]
    p50 = lambda name: "-" if lat[name]["p50"] is None else f"{lat[name]['p50']:.1f}"  # noqa: E731
    return (f"{c['sent']} sent, {c['completed']} completed, {c['failed']} failed; TTFT p50 {p50('ttft')} ms, "
            f"TPOT p50 {p50('tpot')} ms; SLO attainment {100 * slo['attainment']:.1f}%, "
            f"goodput {slo['goodput_rps']:.2f} req/s")
