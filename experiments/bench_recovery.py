"""`tandem bench recovery`: what a worker loss costs under steady load.

Steady closed-loop load runs on a cluster; one worker is killed (Ray restarts it). Reported, from
one run: the time from the kill to the first request that completes successfully having been
routed around the lost worker, the time until the scheduler has reclaimed every KV block it had
committed to the lost worker's requests (and that rate in blocks per second), the time until the
restarted worker is registered again, and how the requests in flight at the kill ended.
"""

from __future__ import annotations

import argparse
import random
import threading
import time
from pathlib import Path

import ray

from actors.protocol.sampling_params import SamplingParams
from cluster.control.config import TandemConfig
from cluster.control.lifecycle.launch import Cluster
from cluster.control.scheduler.scheduler_state import SchedulerState
from cluster.frontend.open_client import open_client
from experiments.bench_report import add_out_argument, report_main

_CONFIG = Path(__file__).resolve().parent.parent / "configs" / "disagg-2p2d.yaml"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default=str(_CONFIG), help="cluster layout (default: configs/disagg-2p2d.yaml)")
    p.add_argument("--victim", default="decode-0", help="worker id to kill")
    p.add_argument("--concurrency", type=int, default=6, help="requests kept in flight")
    p.add_argument("--prompt-len", type=int, default=200)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--warmup-s", type=float, default=3.0, help="steady load before the kill")
    add_out_argument(p, "recovery")
    p.set_defaults(func=report_main("recovery", bench, summarize),
                   smoke={"concurrency": 2, "prompt_len": 32, "max_tokens": 16, "warmup_s": 1.0})


def summarize(r: dict) -> str:
    def s(x: float | None) -> str:
        return "never" if x is None else f"{x:.2f} s"

    rate = r["blocks_reclaimed_per_s"]
    return (f"{r['victim']} killed with {r['in_flight_at_kill']} requests in flight ({r['in_flight_completed']} "
            f"completed); first success around it after {s(r['kill_to_first_success_around_s'])}; "
            f"{r['committed_blocks_at_kill']} blocks reclaimed after {s(r['kill_to_blocks_reclaimed_s'])}"
            + ("" if rate is None else f" ({rate:.0f}/s)")
            + f"; re-registered after {s(r['kill_to_reregistered_s'])}")


class _Load:
    """Closed-loop load: each thread submits one greedy request after another and records it."""

    def __init__(self, cluster: Cluster, concurrency: int, prompt_len: int, max_tokens: int, vocab: int):
        self.client = open_client(cluster)
        self.params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        self.prompt_len, self.vocab = prompt_len, vocab
        self.records: list[dict] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._loop, args=(i,), daemon=True) for i in range(concurrency)]

    def start(self) -> None:
        for t in self._threads:
            t.start()

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=120)

    def _loop(self, seed: int) -> None:
        rng = random.Random(seed)
        while not self._stop.is_set():
            prompt = [rng.randrange(10, self.vocab) for _ in range(self.prompt_len)]
            record = {"submitted": time.monotonic(), "route": {}, "ok": False, "error": None}
            try:
                submitted = self.client.submit(prompt, self.params, timeout_s=60)
                record["route"] = {"prefill": submitted.route.prefill, "decode": submitted.route.decode}
                events = list(self.client.events(submitted, timeout_s=120))
                record["ok"] = events[-1].finish_reason == "length"
                record["error"] = events[-1].error
            except Exception as exc:  # rejected or timed out: recorded, the load goes on
                record["error"] = f"{type(exc).__name__}: {exc}"
            record["done"] = time.monotonic()
            self.records.append(record)


def _state(cluster: Cluster) -> SchedulerState | None:
    try:
        return ray.get(cluster.scheduler.state.remote(), timeout=10)
    except ray.exceptions.RayError:
        return None


def measure(cluster: Cluster, args: argparse.Namespace) -> dict:
    if args.victim not in cluster.workers:
        raise ValueError(f"--victim {args.victim!r} is not a worker of this layout ({sorted(cluster.workers)})")
    load = _Load(cluster, args.concurrency, args.prompt_len, args.max_tokens, vocab=1000)  # ids every model here has
    load.start()
    time.sleep(args.warmup_s)
    before = _state(cluster)
    committed = before.committed_blocks.get(args.victim, 0)
    incarnation = before.incarnations[args.victim]
    killed = time.monotonic()
    ray.kill(cluster.workers[args.victim], no_restart=False)
    reclaimed_at = rejoined_at = None
    while time.monotonic() - killed < 120 and (reclaimed_at is None or rejoined_at is None):
        state = _state(cluster)
        now = time.monotonic()
        if state is not None:
            if reclaimed_at is None and state.committed_blocks.get(args.victim, 0) == 0:
                reclaimed_at = now
            if rejoined_at is None and state.incarnations.get(args.victim) not in (None, incarnation):
                rejoined_at = now
        time.sleep(0.01)
    time.sleep(2.0)  # steady load again, with the restarted worker
    load.stop()

    in_flight = [r for r in load.records if r["submitted"] < killed < r["done"]]
    around = [r for r in load.records if r["submitted"] > killed and r["ok"] and args.victim not in r["route"].values()]
    first_around = min((r["done"] for r in around), default=None)
    reclaim_s = None if reclaimed_at is None else reclaimed_at - killed
    return {
        "victim": args.victim,
        "requests": len(load.records),
        "in_flight_at_kill": len(in_flight),
        "in_flight_completed": sum(r["ok"] for r in in_flight),
        "failed_after_kill": [r["error"] for r in load.records if r["done"] > killed and not r["ok"]],
        "kill_to_first_success_around_s": None if first_around is None else first_around - killed,
        "committed_blocks_at_kill": committed,
        "kill_to_blocks_reclaimed_s": reclaim_s,
        "blocks_reclaimed_per_s": committed / reclaim_s if reclaim_s else None,
        "kill_to_reregistered_s": None if rejoined_at is None else rejoined_at - killed,
        "heartbeat_timeout_s": cluster.config.scheduler.heartbeat_timeout_s,
    }


def bench(args: argparse.Namespace) -> dict:
    cluster = Cluster.start(TandemConfig.from_file(args.config))
    try:
        report = measure(cluster, args)
        state = cluster.check_integrity()
        report["integrity_after"] = "ok"
        report["scheduler_in_flight_after"] = state["scheduler"]["in_flight"]
    finally:
        cluster.shutdown()
    return report
