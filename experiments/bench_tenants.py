"""`tandem bench tenants`: can one tenant's flood slow down or starve another?

One cluster, two tenants behind the real HTTP ingress. Tenant B sends small requests one after another,
streamed; its first token and whole-request latency are measured alone, then while tenant A floods
(threads each sending many prompts x n per request). Both runs are repeated under two ingress policies on
the same cluster: `shares` (the defaults: equal KV shares, the default tokens/minute) and `no_shares`
(each tenant may take the whole pool), so the report shows what the shares change. Reported per policy:
B's p50 and p95 loaded / unloaded (first token and whole request), B's failures, A's answers by status,
and the most KV blocks A held against its share; with `--runs N`, every run and, per ratio, its median
and worst over the runs (a bound that holds in one run of two does not hold).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import random
import statistics
import threading
import time
from collections import Counter
from pathlib import Path

import httpx
import ray

from cluster.control.config import IngressSection, TandemConfig, TenantSection
from cluster.control.lifecycle.launch import Cluster
from cluster.frontend.http.server import make_server, served_model_name
from experiments.bench_report import add_out_argument, report_main

_CONFIG = Path(__file__).resolve().parent.parent / "configs" / "local.yaml"


def _slowdown(value: str) -> float | str | None:
    return value if value == "config" else None if value == "none" else float(value)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default=str(_CONFIG), help="cluster layout (default: configs/local.yaml)")
    p.add_argument("--probes", type=int, default=10, help="tenant B requests per phase")
    p.add_argument("--runs", type=int, default=1, help="runs of both policies on the one cluster (median and worst reported)")
    p.add_argument("--tenant-slowdown", type=_slowdown, default="config",
                   help="engine.tenant_slowdown for this run (a number above 1, or none: steps never cut); "
                        "default: the config's")
    p.add_argument("--queue-timeout-s", type=float, default=10.0,
                   help="the cluster's admission deadline (scheduler.queue_timeout_s): how long a request waits for room")
    p.add_argument("--probe-max-tokens", type=int, default=16)
    p.add_argument("--flooders", type=int, default=4, help="tenant A threads, each one streamed request at a time")
    p.add_argument("--flood-prompts", type=int, default=1, help="prompts in each of A's requests")
    p.add_argument("--flood-n", type=int, default=16, help="n of each of A's requests")
    p.add_argument("--flood-prompt-len", type=int, default=64, help="tokens in each of A's prompts")
    p.add_argument("--flood-max-tokens", type=int, default=1020,
                   help="with the other defaults, one of A's requests commits 1024 KV blocks (a quarter of local.yaml's)")
    add_out_argument(p, "tenants")
    p.set_defaults(func=report_main("tenants", bench, summarize),
                   smoke={"probes": 3, "flooders": 2, "flood_n": 4, "flood_max_tokens": 8})


RATIOS = ("b_ttft_p50_ratio", "b_ttft_p95_ratio", "b_p50_ratio", "b_p95_ratio")


def distribution(runs: list[dict]) -> dict:
    """Per ratio, its median and worst over the runs (a run where every B request failed counts as worst)."""
    out = {}
    for key in RATIOS:
        values = [run[key] for run in runs]
        seen = sorted(v for v in values if v is not None)
        out[key] = {"median": statistics.median(seen) if seen else None,
                    "worst": None if None in values or not seen else seen[-1], "runs": values}
    return out


def summarize(r: dict) -> str:
    parts = []
    for name, runs in r.get("runs", {}).items():
        d = distribution(runs)
        parts.append(f"{name} over {len(runs)} runs: B's first token p50 median {_x(d['b_ttft_p50_ratio']['median'])}, "
                     f"worst {_x(d['b_ttft_p50_ratio']['worst'])} (p95 worst {_x(d['b_ttft_p95_ratio']['worst'])}); "
                     f"whole request p50 median {_x(d['b_p50_ratio']['median'])}, worst {_x(d['b_p50_ratio']['worst'])}")
    for name, p in r["policies"].items():
        parts.append(f"{name}{' (last run)' if r.get('runs') else ''}: B's first token p50 {_x(p['b_ttft_p50_ratio'])} "
                     f"(p95 {_x(p['b_ttft_p95_ratio'])}), whole request p50 {_x(p['b_p50_ratio'])} "
                     f"(p95 {_x(p['b_p95_ratio'])}) under A's flood, B failed {p['b_failed']}, A answered "
                     f"{p['a_statuses']}, A held <= {p['a_peak_blocks']} of {p['pool_blocks']} blocks")
    return "; ".join(parts)


def _x(v: float | None) -> str:
    return "n/a (every request failed)" if v is None else f"x{v:.2f}"


def _policy(name: str) -> IngressSection:
    if name == "shares":
        tenants = {"key-a": TenantSection(tenant="a"), "key-b": TenantSection(tenant="b")}
        return IngressSection(api_keys=tenants)
    whole = {"key-a": TenantSection(tenant="a", kv_share=1.0), "key-b": TenantSection(tenant="b", kv_share=1.0)}
    return IngressSection(api_keys=whole, default_tokens_per_minute=None)


def _probe(url: str, model: str, args, count: int) -> tuple[list[float], list[float], list[str]]:
    """B's requests one after another, streamed: (seconds to the first token, seconds to the end, failures)."""
    ttfts, latencies, failures = [], [], []
    body = {"model": model, "prompt": "tenant b asks a short question", "max_tokens": args.probe_max_tokens,
            "temperature": 0.0, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=300, headers={"Authorization": "Bearer key-b"}) as http:
        for _ in range(count):
            started, first = time.perf_counter(), None
            with http.stream("POST", url + "/v1/completions", json=body) as answer:
                if answer.status_code != 200:
                    failures.append(f"{answer.status_code}: {json.loads(answer.read())['error']['message']}")
                    continue
                for line in answer.iter_lines():
                    if first is None and line.startswith("data: {") and json.loads(line[6:])["choices"]:
                        first = time.perf_counter() - started
            if first is None:
                failures.append("200 without a token")
                continue
            ttfts.append(first)
            latencies.append(time.perf_counter() - started)
    return ttfts, latencies, failures


class _Flood:
    """Tenant A: threads of a process of its own (as A's clients would be: not sharing the ingress's
    interpreter lock), each streaming one big request after another until stopped, then hanging up (the
    ingress aborts what it was generating)."""

    def __init__(self, url: str, model: str, args):
        self.statuses: Counter[str] = Counter()
        body = {"model": model, "n": args.flood_n, "max_tokens": args.flood_max_tokens, "temperature": 1.0,
                "ignore_eos": True, "stream": True}
        shape = (args.flood_prompts, args.flood_prompt_len)
        spawn = multiprocessing.get_context("spawn")
        self._stop, self._answered, self._out = spawn.Event(), spawn.Event(), spawn.Queue()
        self._process = spawn.Process(target=_flood, args=(url, body, shape, args.flooders, self._stop,
                                                           self._answered, self._out), daemon=True)

    def __enter__(self) -> _Flood:
        self._process.start()
        if not self._answered.wait(timeout=300):
            raise RuntimeError("tenant A's flood got no answer within 300s")
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self.statuses.update(self._out.get(timeout=600))
        self._process.join(timeout=60)


def _flood(url: str, body: dict, shape: tuple[int, int], threads: int, stop, answered, out) -> None:
    """The flood process: `threads` clients until `stop` (`answered` is set at the first answer), then their
    answers by status into `out`. Every request has fresh prompts (`shape`: prompts x tokens): a prompt
    repeated would be a prefix-cache hit, no prefill work at all."""
    statuses: Counter[str] = Counter()
    lock = threading.Lock()

    def loop(seed: int) -> None:
        rng = random.Random(seed)
        with httpx.Client(timeout=600, headers={"Authorization": "Bearer key-a"}) as http:
            while not stop.is_set():
                prompts = [[rng.randrange(10, 1000) for _ in range(shape[1])] for _ in range(shape[0])]
                with http.stream("POST", url + "/v1/completions", json={**body, "prompt": prompts}) as answer:
                    with lock:
                        statuses[str(answer.status_code)] += 1
                    answered.set()
                    for _ in answer.iter_lines():
                        if stop.is_set():
                            break
                if answer.status_code == 429:
                    stop.wait(min(5.0, float(answer.headers.get("retry-after", "1"))))

    clients = [threading.Thread(target=loop, args=(seed,), daemon=True) for seed in range(threads)]
    for t in clients:
        t.start()
    for t in clients:
        t.join(timeout=600)
    out.put(dict(statuses))


def _watch_blocks(cluster: Cluster, stop: threading.Event, peak: dict) -> None:
    while not stop.is_set():
        state = ray.get(cluster.scheduler.state.remote(), timeout=30)
        for tenant, blocks in state.tenant_blocks.items():
            peak[tenant] = max(peak.get(tenant, 0), blocks)
        time.sleep(0.25)  # often enough for a peak that lasts seconds; a tighter poll loads the scheduler measured


def _run_policy(cluster: Cluster, name: str, args) -> dict:
    model = served_model_name(cluster)
    http = make_server(cluster, "127.0.0.1", 0, _policy(name))
    thread = threading.Thread(target=http.run, daemon=True)
    thread.start()
    while not http.started:
        time.sleep(0.05)
    url = f"http://127.0.0.1:{http.servers[0].sockets[0].getsockname()[1]}"
    try:
        _probe(url, model, args, 2)  # warm-up
        alone_ttft, alone, alone_failed = _probe(url, model, args, args.probes)
        peak: dict[str, int] = {}
        stop = threading.Event()
        watcher = threading.Thread(target=_watch_blocks, args=(cluster, stop, peak), daemon=True)
        watcher.start()
        with _Flood(url, model, args) as flood:
            time.sleep(2.0)  # the flood fills the pool first
            loaded_ttft, loaded, loaded_failed = _probe(url, model, args, args.probes)
        stop.set()
        watcher.join(timeout=30)
    finally:
        http.should_exit = True
        thread.join(timeout=30)
    state = ray.get(cluster.scheduler.state.remote(), timeout=30)
    pool = [v for v in state.workers.values() if v.role in ("decode", "colocated")]

    def q(xs: list[float], p: int) -> float | None:
        return statistics.quantiles(xs, n=100, method="inclusive")[p - 1] if len(xs) > 1 else (xs[0] if xs else None)

    def ratio(p: int, alone: list[float] = alone, loaded: list[float] = loaded) -> float | None:
        return None if q(loaded, p) is None or q(alone, p) is None else q(loaded, p) / q(alone, p)

    return {
        "b_alone_p50_s": q(alone, 50), "b_loaded_p50_s": q(loaded, 50),
        "b_p50_ratio": ratio(50), "b_p95_ratio": ratio(95),
        "b_ttft_alone_p50_s": q(alone_ttft, 50), "b_ttft_loaded_p50_s": q(loaded_ttft, 50),
        "b_ttft_p50_ratio": ratio(50, alone_ttft, loaded_ttft), "b_ttft_p95_ratio": ratio(95, alone_ttft, loaded_ttft),
        "b_failed": len(alone_failed) + len(loaded_failed), "b_failures": alone_failed + loaded_failed,
        "a_statuses": dict(flood.statuses), "a_peak_blocks": peak.get("a", 0), "b_peak_blocks": peak.get("b", 0),
        "pool_blocks": sum(v.num_blocks for v in pool),
    }


def bench(args: argparse.Namespace) -> dict:
    config = TandemConfig.from_file(args.config)
    scheduler = config.scheduler.model_copy(update={"queue_timeout_s": args.queue_timeout_s})
    engine = config.engine
    if args.tenant_slowdown != "config":
        engine = engine.model_copy(update={"tenant_slowdown": args.tenant_slowdown})
    cluster = Cluster.start(config.model_copy(update={"scheduler": scheduler, "engine": engine}))
    try:
        runs: dict[str, list[dict]] = {"no_shares": [], "shares": []}
        for _ in range(args.runs):
            for name in runs:
                runs[name].append(_run_policy(cluster, name, args))
        state = cluster.check_integrity()
    finally:
        cluster.shutdown()
    policies = {name: done[-1] for name, done in runs.items()}  # the last run, as a single run reports it
    return {"policies": policies, "runs": runs if args.runs > 1 else {},
            "distribution": {name: distribution(done) for name, done in runs.items()},
            "scheduler_in_flight_after": state["scheduler"]["in_flight"],
            "tenant_slowdown": engine.tenant_slowdown,
            "flood": {"threads": args.flooders, "prompts": args.flood_prompts, "n": args.flood_n,
                      "max_tokens": args.flood_max_tokens}}
