"""`tandem COMMAND ...`: the parser and the dispatch.

Each command is a module with `add_arguments(parser)`, which sets `func` (and, for a measuring tool,
its `smoke` sizes); only the module of the command being run is imported, so `tandem --help` lists
every command without loading any of them, and `tandem serve` needs only the core dependencies.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from dataclasses import dataclass


@dataclass(frozen=True)
class Command:
    module: str
    help: str


PRODUCT = {
    "generate": Command("tandem.generate", "run the engine offline in this process and print one completion"),
    "serve": Command("tandem.serve", "start the cluster from a config and serve until Ctrl-C"),
    "scale": Command("tandem.scale", "resize the pools of a running `tandem serve` (new workers register; "
                                     "removed ones drain first)"),
}
PLAN = Command("experiments.planner.cli",
               "simulate the cluster and recommend prefill/decode pool sizes under SLOs")
BENCH = {
    "engine": Command("experiments.bench_engine", "offline engine throughput vs HF (and vLLM)"),
    "structured": Command("experiments.bench_structured", "the structured-output grammar mask's cost per step"),
    "cluster": Command("experiments.bench_cluster", "cluster stack overhead: TPOT and idle TTFT vs the engine"),
    "recovery": Command("experiments.bench_recovery",
                        "kill a worker under load: time to route around it, blocks reclaimed/s"),
    "tenants": Command("experiments.bench_tenants",
                       "one tenant floods: the other's latency and KV, with and without shares"),
    "chaos": Command("experiments.bench_chaos",
                     "SIGKILL a random worker every few seconds under HTTP streams: exact / error / hung"),
    "link": Command("experiments.bench_link",
                    "TTFT vs the prefill -> decode link's rate on the namespaced cluster (root)"),
    "control-plane": Command("experiments.fleet.bench_control_plane",
                             "the scheduler with N simulated workers: admissions/s, decision time p50/p99"),
    "serve": Command("experiments.loadgen.cli",
                     "open-loop load against an OpenAI-compatible server: latency, SLO goodput"),
    "autoscale": Command("experiments.autoscale.cli",
                         "the SLO autoscaler vs the best static layout on a 4-phase trace (simulated fleet)"),
    "flip": Command("experiments.bench_role_flip",
                    "a worker changing role (prefill <-> decode) vs a cold start, under greedy load"),
    "compare": Command("experiments.compare.cli",
                       "the same trace against colocated and disaggregated layouts of equal resources"),
}

# Packages of an optional extra (pyproject's [project.optional-dependencies]) -> that extra. A tool
# that needs one and finds it missing says what to install instead of printing a traceback.
EXTRAS = {"openai": "bench", "matplotlib": "bench"}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        args = _parser(argv).parse_args(argv)
        if args.command in ("bench", "plan"):
            from experiments.smoke import shrink

            shrink(args, getattr(args, "smoke", None))  # TANDEM_SMOKE=1: the tools at toy sizes
        return args.func(args)
    except ValueError as exc:
        print(f"tandem: error: {exc}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as exc:
        extra = EXTRAS.get((exc.name or "").partition(".")[0])
        if extra is None:
            raise
        print(f"tandem: error: this command needs the optional package {exc.name!r}: "
              f"pip install -e '.[{extra}]' (or pip install 'tandem[{extra}]')", file=sys.stderr)
        return 2


def _parser(argv: list[str]) -> argparse.ArgumentParser:
    """The whole command tree, with arguments only for the command named in `argv`."""
    chosen = [a for a in argv if not a.startswith("-")][:2]
    parser = argparse.ArgumentParser(prog="tandem", description="LLM serving with disaggregated prefill and decode")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, command in PRODUCT.items():
        _add(sub, name, command, load=chosen[:1] == [name])
    bench = sub.add_parser("bench", help="benchmarks",
                           description="benchmarks (a tool that needs the optional 'bench' packages says so)")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True, metavar="BENCHMARK")
    for name, command in BENCH.items():
        _add(bench_sub, name, command, load=chosen == ["bench", name])
    _add(sub, "plan", PLAN, load=chosen[:1] == ["plan"])
    return parser


def _add(sub, name: str, command: Command, load: bool) -> None:
    p = sub.add_parser(name, help=command.help, description=command.help)
    if load:
        importlib.import_module(command.module).add_arguments(p)


if __name__ == "__main__":
    sys.exit(main())
