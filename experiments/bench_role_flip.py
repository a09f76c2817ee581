"""`tandem bench flip`: what a role flip costs against a cold start, under greedy load.

The config's layout with one more prefill worker runs a closed loop of greedy requests (fixed prompts,
each answer checked against the answer the cluster gave before any change). Each round: one prefill
worker flips to decode and back (`scale(..., flips=True)`), then one decode worker is added cold and
removed again. Reported from one run: the flip's time from the decision until the worker serves in its
new role (its drain, then the switch), the cold start's time from the decision until the new worker
serves (process start, imports, weights), their ratio, and how every request during the run ended.
"""

from __future__ import annotations

import argparse
import random
import statistics
import threading
import time
from pathlib import Path

import ray

from actors.protocol.sampling_params import SamplingParams
from cluster.control.config import TandemConfig
from cluster.control.lifecycle.launch import Cluster
from cluster.control.lifecycle.scaling import scale
from cluster.frontend.open_client import open_client
from experiments.bench_report import add_out_argument, report_main

_CONFIG = Path(__file__).resolve().parent.parent / "configs" / "default.yaml"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default=str(_CONFIG),
                   help="cluster layout, run with one more prefill worker (default: configs/default.yaml, SmolLM2)")
    p.add_argument("--rounds", type=int, default=3, help="flips there and back, and cold starts, each")
    p.add_argument("--concurrency", type=int, default=4, help="requests kept in flight")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--serve-s", type=float, default=5.0, help="how long the flipped worker decodes before it flips back")
    add_out_argument(p, "flip")
    p.set_defaults(func=report_main("flip", bench, summarize),
                   smoke={"config": str(_CONFIG.with_name("local.yaml")), "rounds": 1, "concurrency": 1,
                          "prompt_len": 16, "max_tokens": 8, "serve_s": 1.0})


def summarize(r: dict) -> str:
    return (f"flip prefill->decode {r['flip_s']:.2f} s median (drain {r['flip_drain_s']:.2f} + switch "
            f"{r['flip_switch_s']:.2f}), decode->prefill after {r['serve_s']:g} s of decoding {r['flip_back_s']:.2f} s "
            f"(drain {r['flip_back_drain_s']:.2f}; it had adopted {r['flipped_worker_adopted']} handoffs), vs cold start "
            f"{r['cold_start_s']:.2f} s: cold / flip {r['cold_over_flip']:.1f}x; {r['requests']} greedy requests "
            f"during the run, {r['failed']} failed, {r['wrong']} with other tokens; integrity {r['integrity_after']}")


class _Traffic:
    """Closed-loop greedy requests over fixed prompts; each answer is compared with the reference."""

    def __init__(self, cluster: Cluster, prompts: list[list[int]], params: SamplingParams,
                 reference: list[list[int]], concurrency: int):
        self.client, self.prompts, self.params, self.reference = open_client(cluster), prompts, params, reference
        self.requests = self.failed = self.wrong = 0
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._loop, args=(i,), daemon=True) for i in range(concurrency)]
        for t in self._threads:
            t.start()

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=120)

    def _loop(self, k: int) -> None:
        while not self._stop.is_set():
            i = (k + self.requests) % len(self.prompts)
            try:
                (r,) = self.client.generate([self.prompts[i]], self.params, timeout_s=120)[0]
                self.failed += r.finish_reason != "length"
                self.wrong += r.finish_reason == "length" and r.token_ids != self.reference[i]
                if r.error:
                    self.errors.append(r.error)
            except Exception as exc:  # recorded; the load goes on
                self.failed += 1
                self.errors.append(f"{type(exc).__name__}: {exc}")
            self.requests += 1


def _adopted(cluster: Cluster, worker_id: str) -> int:
    """Handoffs the worker has adopted (as the scheduler last heard)."""
    stats = ray.get(cluster.scheduler.state.remote(), timeout=30).as_dict()["worker_stats"]
    return stats.get(worker_id, {}).get("adopted", 0)


def bench(args: argparse.Namespace) -> dict:
    config = TandemConfig.from_file(args.config)
    prefill, decode = config.prefill.replicas + 1, config.decode.replicas
    config = config.model_copy(update={"prefill": config.prefill.model_copy(update={"replicas": prefill})})
    cluster = Cluster.start(config)
    try:
        rng = random.Random(7)
        prompts = [[rng.randrange(10, 1000) for _ in range(args.prompt_len)] for _ in range(32)]
        params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
        reference = [r[0].token_ids for r in open_client(cluster).generate(prompts, params)]
        traffic = _Traffic(cluster, prompts, params, reference, args.concurrency)
        flips, backs, colds, removals = [], [], [], []
        try:
            for _ in range(args.rounds):
                time.sleep(1.0)
                (there,) = scale(cluster, {"prefill": prefill - 1, "decode": decode + 1}, flips=True)["flipped"]
                time.sleep(args.serve_s)  # it serves as a decode worker, and has answers to finish when it flips back
                there["adopted_then"] = _adopted(cluster, there["to"])
                flips.append(there)
                backs += scale(cluster, {"prefill": prefill, "decode": decode}, flips=True)["flipped"]
                start = time.monotonic()
                scale(cluster, {"decode": decode + 1})
                colds.append(time.monotonic() - start)
                start = time.monotonic()
                scale(cluster, {"decode": decode})
                removals.append(time.monotonic() - start)
            time.sleep(1.0)
        finally:
            traffic.stop()
        state = cluster.check_integrity()
    finally:
        cluster.shutdown()
    if any(f["cold"] for f in flips + backs):
        raise RuntimeError(f"a flip fell back to a cold start: {flips + backs}")
    flip_s = statistics.median(f["seconds"] for f in flips)
    cold_s = statistics.median(colds)
    return {
        "config": args.config, "layout": f"{prefill}P+{decode}D, flipping one prefill worker", "rounds": args.rounds,
        "flip_s": flip_s, "flip_drain_s": statistics.median(f["drained_s"] for f in flips),
        "flip_switch_s": statistics.median(f["switched_s"] for f in flips),
        "flip_back_s": statistics.median(f["seconds"] for f in backs), "serve_s": args.serve_s,
        "flip_back_drain_s": statistics.median(f["drained_s"] for f in backs), "cold_start_s": cold_s,
        "flipped_worker_adopted": [f["adopted_then"] for f in flips],
        "cold_over_flip": cold_s / flip_s, "removal_s": statistics.median(removals),
        "flips": flips, "flips_back": backs, "cold_starts_s": colds,
        "requests": traffic.requests, "failed": traffic.failed, "wrong": traffic.wrong, "errors": traffic.errors[:5],
        "integrity_after": "ok", "scheduler_in_flight_after": state["scheduler"]["in_flight"],
    }
