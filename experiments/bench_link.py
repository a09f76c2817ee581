"""`tandem bench link`: time to first tokens against the bandwidth of the prefill -> decode link.

Runs on the namespaced cluster (experiments/netns_cluster.sh, root only): the prefill worker on host
w1, the decode worker on w2, `tandem serve` on the head, KV over tcp across the bridge. For each rate
the w1 -> w2 link is shaped (an HTB class: this kernel has no netem) and `--requests` prompts of
`--prompt-tokens` random tokens (no prefix in common: every prompt is computed and, when remote, sent
whole) are streamed one at a time through the HTTP API, 4 tokens each. The first token is sampled
on the prefill worker and streamed before the handoff; the second comes from the decode worker once
the KV has crossed the link. So the link shows in the second token's time (the decode side's time to
first token), measured by the client from the request; the first token's time is reported beside it.

Two layouts per rate, each a fresh `tandem serve`:
- `remote`: `scheduler.local_prefill: false`: every prompt is prefilled on w1 and its KV crosses the
  link, so TTFT shows what the link costs;
- `cost_model`: the default: the scheduler may prefill on the decode worker when its measured link
  cost (cluster/control/scheduler/link_costs.py) makes a remote prefill slower.

Reported per layout and rate: first- and second-token p50/p95, how many prompts were prefilled on the decode worker (the
handoffs counted by the workers), and the link bandwidth and latency the scheduler measured against
the shaped rate. The numbers are one run's, on a shared box: read them as ratios.
"""

from __future__ import annotations

import argparse
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import yaml
from prometheus_client.parser import text_string_to_metric_families

from cluster.control.config import TandemConfig
from experiments.bench_report import add_out_argument, out_path, summary_line, write_json

_REPO = Path(__file__).resolve().parent.parent
_SCRIPT = _REPO / "experiments" / "netns_cluster.sh"
_HEAD_IP = "198.51.100.10"
_URL = f"http://{_HEAD_IP}:8000"
_LAYOUTS = ("remote", "cost_model")
_API_KEY = "bench-link-key"  # the ingress listens on the bridge: not anonymously


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rates", default="unshaped,2gbit,500mbit,100mbit,20mbit,5mbit",
                   help="w1 -> w2 link rates (tc units), `unshaped` for none")
    p.add_argument("--requests", type=int, default=8, help="prompts per layout and rate (after 2 to measure)")
    p.add_argument("--prompt-tokens", type=int, default=1024)
    p.add_argument("--seed", type=int, default=0)
    add_out_argument(p, "link", beside="the plot goes beside it")
    p.set_defaults(func=main, smoke={"requests": 2, "rates": "unshaped,20mbit"})


def _netns(*args: str, timeout_s: float = 300) -> str:
    env = {**os.environ, "RAY_AUTH_MODE": "token", "PYTHONPATH": str(_REPO)}
    done = subprocess.run([str(_SCRIPT), *args], capture_output=True, text=True, timeout=timeout_s, env=env)
    if done.returncode:
        raise RuntimeError(f"netns_cluster.sh {' '.join(args)} failed: {done.stderr[-2000:]}")
    return done.stdout


def _config(tmp: Path, layout: str) -> Path:
    config = TandemConfig.from_file(_REPO / "configs" / "local.yaml").model_dump(mode="json", exclude_none=True)
    config["prefill"].update(resources={"tandem_prefill": 1}, num_cpus=1)
    config["decode"].update(resources={"tandem_decode": 1}, num_cpus=1, replicas=1)
    config["scheduler"].update(local_prefill=layout == "cost_model")
    config["transfer"].update(zmq_transport="tcp", host="0.0.0.0")
    config["ingress"].update(host=_HEAD_IP, port=8000, api_keys={_API_KEY: {"tenant": "bench-link"}})
    path = tmp / f"link-{layout}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


class _Served:
    """`tandem serve` on the head for one layout."""

    def __init__(self, config: Path):
        self._log = config.with_suffix(".log")
        env = {**os.environ, "RAY_AUTH_MODE": "token", "PYTHONPATH": str(_REPO)}
        with self._log.open("w") as out:
            self._proc = subprocess.Popen([str(_SCRIPT), "run", "head", sys.executable, "-m", "tandem.cli", "serve",
                                           "--address", "auto", "--config", str(config)],
                                          stdout=out, stderr=subprocess.STDOUT, env=env)

    def __enter__(self) -> _Served:
        deadline = time.monotonic() + 300
        while True:
            if self._proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("tandem serve did not become ready: " + self._log.read_text()[-3000:])
            try:
                if httpx.get(_URL + "/ready", timeout=5).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(1)

    def __exit__(self, *exc) -> None:
        # nsenter does not pass signals on: Ctrl-C the server inside the head's PID namespace, and wait
        # until it has stopped, or the next layout's server would find this one still answering.
        subprocess.run([str(_SCRIPT), "run", "head", "pkill", "-INT", "-f", "tandem.cli serve"],
                       capture_output=True, timeout=60)
        try:
            self._proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            self._proc.kill()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                httpx.get(_URL + "/ready", timeout=2)
            except httpx.HTTPError:
                return
            time.sleep(1)
        raise RuntimeError("the previous tandem serve still answers")


def _metrics() -> dict[str, dict[str, float]]:
    text = httpx.get(_URL + "/metrics", timeout=30).text
    out: dict[str, dict[str, float]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.setdefault(s.name, {})[",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))] = s.value
    return out


def _handoffs() -> tuple[float, float]:
    """(handoffs adopted, KV bytes sent) so far, as the workers last reported them."""
    time.sleep(1.0)  # /metrics shows the workers' last reports
    m = _metrics()
    return m.get("tandem:kv_transfers", {}).get("outcome=adopted", 0.0), sum(m.get("tandem:kv_transfer_bytes", {}).values())


def _timings(client: openai.OpenAI, prompt: list[int]) -> tuple[float, float]:
    """(first token, second token) seconds after the request, the whole stream read (leaving early
    would abort the request, and with it its handoff)."""
    start, emits = time.monotonic(), []
    for chunk in client.completions.create(model="tiny-llama", prompt=prompt, max_tokens=4, temperature=0,
                                           stream=True, extra_body={"ignore_eos": True}):
        if chunk.choices and chunk.choices[0].text:
            emits.append(time.monotonic() - start)
    if len(emits) < 2:
        raise RuntimeError(f"the stream ended after {len(emits)} tokens")
    return emits[0], emits[1]


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def _run_rate(client: openai.OpenAI, rng: random.Random, rate: str, args) -> dict:
    if rate != "unshaped":
        _netns("shape", "w1", "w2", "rate", rate)
    try:
        prompts = [[rng.randrange(10, 2000) for _ in range(args.prompt_tokens)] for _ in range(args.requests + 2)]
        for prompt in prompts[:2]:  # the link is measured on these (or its old fit is dropped: not in 30 s)
            _timings(client, prompt)
        before = _handoffs()
        times = [_timings(client, prompt) for prompt in prompts[2:]]
        after = _handoffs()
        remote = int(after[0] - before[0])
        links = _metrics()
        bandwidth = links.get("tandem:kv_link_bytes_per_second", {})
        latency = links.get("tandem:kv_link_latency_seconds", {})
    finally:
        if rate != "unshaped":
            _netns("heal", "w1")
    ttfts, seconds = [t[0] for t in times], [t[1] for t in times]
    return {"rate": rate, "ttft_p50_s": round(_percentile(ttfts, 0.5), 4), "ttft_p95_s": round(_percentile(ttfts, 0.95), 4),
            "second_token_p50_s": round(_percentile(seconds, 0.5), 4),
            "second_token_p95_s": round(_percentile(seconds, 0.95), 4),
            "requests": len(times), "prefilled_remote": remote,
            "kv_bytes_per_handoff": round((after[1] - before[1]) / remote) if remote else None, "prefilled_local": len(times) - remote,
            "link_bytes_per_s": {k.removeprefix("link="): round(v) for k, v in bandwidth.items()},
            "link_latency_s": {k.removeprefix("link="): round(v, 4) for k, v in latency.items()}}


def bench(args) -> dict:
    import openai  # the 'bench' extra: imported here so that `--help` works without it

    if os.geteuid() != 0:
        raise SystemExit("tandem bench link needs root (network namespaces)")
    rates = [r.strip() for r in args.rates.split(",") if r.strip()]
    rng = random.Random(args.seed)
    results: dict[str, list[dict]] = {}
    _netns("down")
    try:
        _netns("up", "2")
        _netns("ray-up")
        with tempfile.TemporaryDirectory() as tmp:
            for layout in _LAYOUTS:
                with _Served(_config(Path(tmp), layout)):
                    client = openai.OpenAI(base_url=_URL + "/v1", api_key=_API_KEY, timeout=600, max_retries=0)
                    results[layout] = []
                    for rate in rates:
                        results[layout].append(_run_rate(client, rng, rate, args))
                        print(layout, results[layout][-1], flush=True)
    finally:
        _netns("down")
    kv = [r["kv_bytes_per_handoff"] for r in results.get("remote", []) if r["kv_bytes_per_handoff"]]
    return {"prompt_tokens": args.prompt_tokens, "requests": args.requests, "rates": rates, "layouts": results,
            "kv_bytes_per_prompt": kv[0] if kv else None}


def _rate_bytes_per_s(rate: str) -> float | None:
    units = {"gbit": 1e9, "mbit": 1e6, "kbit": 1e3}
    for unit, bits in units.items():
        if rate.endswith(unit):
            return float(rate.removesuffix(unit)) * bits / 8
    return None


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for layout, rows in report["layouts"].items():
        labels = [r["rate"] for r in rows]
        line = left.plot(labels, [r["second_token_p50_s"] * 1000 for r in rows], marker="o",
                         label=f"{layout}: 2nd token p50")[0]
        left.plot(labels, [r["ttft_p50_s"] * 1000 for r in rows], marker="x", linestyle=":", color=line.get_color(),
                  label=f"{layout}: 1st token p50")
    left.set_yscale("log")
    left.set_xlabel("prefill -> decode link rate")
    left.set_ylabel("ms after the request")
    kv = report["kv_bytes_per_prompt"]
    left.set_title(f"{report['prompt_tokens']}-token prompts" + (f" ({kv >> 10} KiB of KV each)" if kv else ""))
    left.legend()
    rows = report["layouts"]["remote"]
    shaped = [(r["rate"], _rate_bytes_per_s(r["rate"]), sum(r["link_bytes_per_s"].values())) for r in rows]
    labels = [s[0] for s in shaped]
    right.plot(labels, [s[2] / 1e6 for s in shaped], marker="o", label="scheduler's estimate")
    right.plot(labels, [(s[1] or float("nan")) / 1e6 for s in shaped], marker="s", linestyle="--", label="tc rate")
    local = report["layouts"]["cost_model"]
    ax2 = right.twinx()
    ax2.bar(labels, [r["prefilled_local"] / r["requests"] for r in local], alpha=0.25, color="gray")
    ax2.set_ylabel("cost_model: share prefilled on the decode worker")
    ax2.set_ylim(0, 1)
    right.set_yscale("log")
    right.set_xlabel("prefill -> decode link rate")
    right.set_ylabel("MB/s")
    right.set_title("measured link vs shaped rate")
    right.legend(loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def summarize(report: dict) -> str:
    parts = []
    for layout, rows in report["layouts"].items():
        first, last = rows[0], rows[-1]
        parts.append(f"{layout}: 2nd token p50 {first['second_token_p50_s'] * 1000:.0f} ms at {first['rate']} -> "
                     f"{last['second_token_p50_s'] * 1000:.0f} ms at {last['rate']} "
                     f"(local prefills {first['prefilled_local']}/{first['requests']} -> "
                     f"{last['prefilled_local']}/{last['requests']})")
    return "; ".join(parts)


def main(args: argparse.Namespace) -> int:
    out = out_path("link", args.out)
    report = bench(args)
    write_json(out, report)
    png = out.with_suffix(".png")
    plot(report, png)
    print(summary_line("link", summarize(report), out, [png]), flush=True)
    return 0
