"""The arithmetic of `experiments/serve_vs_vllm.sh`: its derived tandem configs, the markdown table of its
runs, the ratios of each tandem layout to vLLM, and each server's capacity.

Every run is a result JSON that `vllm bench serve --save-result` wrote, at OUT/<server>/rate-<r>.json
(<r> with two decimals). A request is *within the SLO* exactly when vLLM counts it in its goodput:
it completed, its TTFT <= the TTFT SLO and its TPOT <= the TPOT SLO, where TPOT = (end-to-end latency -
TTFT) / (output tokens - 1) (0 for a one-token answer). vLLM saves that count only as a rate,
`request_goodput` = within / `duration`, so within = round(request_goodput * duration) recovers it exactly;
failed requests and requests never sent count against the fraction (within / `num_prompts`).

    python -m experiments.serve_table goodput                  # the SLO as `vllm bench serve --goodput` takes it
    python -m experiments.serve_table configs OUT DTYPE        # writes OUT/{1p1d,colocated}.yaml
    python -m experiments.serve_table meets OUT/x/rate-0.50.json  # exit 0 iff >= 90% within the SLO
    python -m experiments.serve_table table OUT "0.5 1.0"       # the table and the ratios to vLLM
    python -m experiments.serve_table capacity OUT             # each server's capacity, from all its runs
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import yaml

from cluster.control.config import TandemConfig

SERVERS = {"vllm": "vLLM", "tandem-1p1d": "tandem 1P+1D", "tandem-colocated": "tandem colocated, 2 threads"}
BASELINE = "vllm"
SLO_TTFT_MS = 2000
SLO_TPOT_MS = 100
CAPACITY_SHARE = 0.9  # a rate holds when at least this share of its requests is within the SLO
CAPACITY_STEP = 0.25  # req/s
DEFINITION = (f"capacity: the highest rate r in steps of {CAPACITY_STEP} req/s such that at r and every step below "
              f"it >= {CAPACITY_SHARE:.0%} of the requests sent completed with TTFT <= {SLO_TTFT_MS} ms and TPOT "
              f"<= {SLO_TPOT_MS} ms (vLLM's goodput test: TPOT = (latency - TTFT) / (output tokens - 1)); "
              f"'>= r' where no step above r was run")


def rate_name(rate: float) -> str:
    return f"{rate:.2f}"


def result_path(out: Path, server: str, rate: float) -> Path:
    return out / server / f"rate-{rate_name(rate)}.json"


def within_slo(result: dict) -> int:
    """Requests vLLM counted in its goodput (see the module docstring)."""
    if result.get("request_goodput") is None:
        raise ValueError("this result has no request_goodput: run `vllm bench serve` with --goodput")
    return round(result["request_goodput"] * result["duration"])


def slo_share(result: dict) -> float:
    return within_slo(result) / result["num_prompts"]


def meets_slo(result: dict) -> bool:
    return slo_share(result) >= CAPACITY_SHARE


def capacity(shares: dict[float, float]) -> tuple[float, bool]:
    """(highest passing rate, whether a failing step above it was run) from rate -> share within the SLO.
    0.0 when the first step fails or was not run."""
    steps = 0
    while (rate := round((steps + 1) * CAPACITY_STEP, 2)) in shares and shares[rate] >= CAPACITY_SHARE:
        steps += 1
    return steps * CAPACITY_STEP, rate in shares


def _ratio(tandem: float, vllm: float) -> str:
    return f"{tandem / vllm:.2f}x" if vllm else "n/a (vLLM's is 0)"


def _ordered(runs: dict[tuple[float, str], dict]) -> list[tuple[float, str]]:
    return sorted(runs, key=lambda key: (key[0], list(SERVERS).index(key[1])))


def table(runs: dict[tuple[float, str], dict]) -> str:
    """The markdown table of (rate, server) -> result, rows in rate then SERVERS order."""
    lines = ["| rate | server | goodput req/s | TTFT p50 / p99 ms | TPOT p50 ms | ITL p99 ms | within SLO |",
             "|---|---|---|---|---|---|---|"]
    for rate, server in _ordered(runs):
        r = runs[rate, server]
        lines.append(f"| {rate} | {SERVERS[server]} | {r['request_goodput']:.3f} | {r['median_ttft_ms']:.0f} / "
                     f"{r['p99_ttft_ms']:.0f} | {r['median_tpot_ms']:.0f} | {r['p99_itl_ms']:.0f} | "
                     f"{within_slo(r)}/{r['num_prompts']} |")
    return "\n".join(lines)


def ratios(runs: dict[tuple[float, str], dict]) -> list[str]:
    """One line per tandem layout and rate: its TPOT p50, TTFT p50 and goodput over vLLM's."""
    lines = []
    for rate, server in _ordered(runs):
        if server == BASELINE or (rate, BASELINE) not in runs:
            continue
        r, v = runs[rate, server], runs[rate, BASELINE]
        tpot, ttft = (_ratio(r[key], v[key]) for key in ("median_tpot_ms", "median_ttft_ms"))
        lines.append(f"{rate} req/s, {SERVERS[server]} / vLLM: TPOT p50 {tpot}, TTFT p50 {ttft}, goodput "
                     f"{_ratio(r['request_goodput'], v['request_goodput'])}")
    return lines


def load_runs(out: Path, rates: list[float]) -> dict[tuple[float, str], dict]:
    return {(rate, server): json.loads(result_path(out, server, rate).read_text())
            for rate in rates for server in SERVERS if result_path(out, server, rate).is_file()}


def capacity_lines(out: Path) -> list[str]:
    """Each server's capacity from every rate-*.json it has (the capacity search's steps and the table's)."""
    lines = []
    for server, label in SERVERS.items():
        shares = {float(p.stem.removeprefix("rate-")): slo_share(json.loads(p.read_text()))
                  for p in sorted((out / server).glob("rate-*.json"))}
        if not shares:
            continue
        cap, bounded = capacity(shares)
        steps = ", ".join(f"{rate}: {share:.0%}" for rate, share in sorted(shares.items()))
        lines.append(f"{label}: {'' if bounded else '>= '}{cap} req/s (within SLO at {steps})")
    return lines


def derive_configs(out: Path, dtype: str, base: Path = Path("configs/default.yaml")) -> dict[str, Path]:
    """tandem's two layouts at `dtype`: the default 1P+1D, and one colocated worker of 2 torch threads."""
    config = yaml.safe_load(base.read_text())
    config["model"]["dtype"] = dtype
    colocated = {key: value for key, value in config.items() if key not in ("prefill", "decode")}
    colocated["mode"] = "colocated"
    colocated["colocated"] = {"replicas": 1, "num_cpus": 2, "torch_threads": 2}
    paths = {}
    for name, data in (("1p1d", config), ("colocated", colocated)):
        TandemConfig.model_validate(data)  # a derivation the config model refuses fails here, not in a server log
        paths[name] = out / f"{name}.yaml"
        paths[name].write_text(yaml.safe_dump(data, sort_keys=False))
    return paths


def main(argv: list[str]) -> int:
    command = argv[0]
    out = Path(argv[1]) if len(argv) > 1 else None
    if command == "goodput":
        print(f"ttft:{SLO_TTFT_MS} tpot:{SLO_TPOT_MS}")
    elif command == "configs":
        derive_configs(out, argv[2])
    elif command == "meets":
        return 0 if meets_slo(json.loads(out.read_text())) else 1
    elif command == "table":
        runs = load_runs(out, [float(rate) for rate in argv[2].split()])
        print(f"SLO: TTFT <= {SLO_TTFT_MS} ms and TPOT <= {SLO_TPOT_MS} ms\n\n{table(runs)}\n")
        print("\n".join(ratios(runs)))
    elif command == "capacity":
        print(f"{DEFINITION}\n" + "\n".join(capacity_lines(out)))
    else:
        raise ValueError(f"unknown command {command!r}: goodput, configs, meets, table or capacity")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
