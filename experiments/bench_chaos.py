"""`tandem bench chaos`: SIGKILL a random worker process every few seconds while streams run over HTTP.

What an operator would try: a 2P+2D cluster behind the real HTTP ingress, the official `openai` client
streaming greedy requests at a fixed concurrency, and every `--kill-every-s` a random live worker's
process gets SIGKILL (Ray restarts it), on a machine kept busy by `--hog` CPU burners. Every request's
text is compared with the single-process engine's. Reported, from one run: how many completed with
exactly the fault-free text, how many ended with an error (and which errors), how many hung (no end
within `--request-timeout-s`), the kills, and the KV still held once the load stopped (must be 0).
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import random
import signal
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import ray

from actors.engine.engine import Engine
from actors.protocol.sampling_params import SamplingParams
from cluster.control.config import IngressSection, TandemConfig
from cluster.control.launch import Cluster
from cluster.frontend.http.server import make_server, served_model_name
from experiments.bench_report import add_out_argument, report_main

_CONFIG = Path(__file__).resolve().parent.parent / "configs" / "disagg-2p2d.yaml"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default=str(_CONFIG), help="cluster layout (default: configs/disagg-2p2d.yaml)")
    p.add_argument("--requests", type=int, default=60)
    p.add_argument("--concurrency", type=int, default=6, help="streams kept in flight")
    p.add_argument("--kill-every-s", type=float, default=3.0, help="seconds between SIGKILLs")
    p.add_argument("--hog", type=int, default=2, help="CPU-burning processes beside the cluster (0: none)")
    p.add_argument("--request-timeout-s", type=float, default=600.0,
                   help="the client's limit per request: a request still open then counts as hung")
    p.add_argument("--seed", type=int, default=0)
    add_out_argument(p, "chaos")
    p.set_defaults(func=report_main("chaos", bench, summarize), smoke={"requests": 6, "hog": 0})


def summarize(r: dict) -> str:
    return (f"{r['exact']}/{r['requests']} exact ({r['exact_fraction']:.1%}), {r['errors']} clean errors, "
            f"{r['wrong']} wrong text, {r['hung']} hung, {r['kills']} SIGKILLs every {r['kill_every_s']} s "
            f"with {r['hog']} CPU hogs; KV held after: {r['kv_blocks_after']}")


def _burn() -> None:
    while True:
        pass


def _workload(args, engine: Engine) -> tuple[list[list[int]], list[int], list[str]]:
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(10, 1000) for _ in range(rng.randint(4, 60))] for _ in range(args.requests)]
    max_tokens = [rng.randint(40, 160) for _ in prompts]
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in max_tokens]
    expected = [r.outputs[0].text for r in engine.generate(prompts, params)]
    return prompts, max_tokens, expected


class _Killer:
    """Every `every_s`, SIGKILL the process of one live worker, chosen at random (one still restarting
    from an earlier kill is skipped: its process is not there to kill)."""

    def __init__(self, cluster: Cluster, every_s: float, seed: int):
        self._cluster, self._every_s = cluster, every_s
        self._rng = random.Random(seed)
        self._stop = threading.Event()
        self.kills: list[str] = []
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def __enter__(self) -> _Killer:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=60)

    def _loop(self) -> None:
        while not self._stop.wait(self._every_s):
            alive = _worker_pids(self._cluster)  # from Ray's actor table: asking a busy worker would wait
            ids = sorted(alive)
            self._rng.shuffle(ids)
            for wid in ids:
                try:
                    os.kill(alive[wid], signal.SIGKILL)
                except ProcessLookupError:
                    continue
                self.kills.append(wid)
                break


def _worker_pids(cluster: Cluster) -> dict[str, int]:
    """Worker id -> process id of every worker Ray shows alive (Ray's GCS actor table; no public API
    gives a process id without calling the actor)."""
    from ray._private import state

    names = {f"tandem-{wid}": wid for wid in cluster.workers}
    return {names[a["Name"]]: a["Pid"] for a in state.actors().values()
            if a.get("Name") in names and a.get("State") == "ALIVE" and a.get("Pid")}


def _stream(client: openai.OpenAI, model: str, prompt: list[int], max_tokens: int) -> dict:
    import openai

    started = time.monotonic()
    text, finish = [], None
    try:
        for chunk in client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                               stream=True, extra_body={"ignore_eos": True}):
            for choice in chunk.choices:
                text.append(choice.text)
                finish = choice.finish_reason or finish
        out = {"text": "".join(text), "finish_reason": finish}
    except openai.APITimeoutError:
        out = {"hung": True}
    except openai.APIError as exc:
        out = {"error": f"{type(exc).__name__}: {exc}"}
    out["seconds"] = round(time.monotonic() - started, 2)
    return out


def _kv_after(cluster: Cluster, timeout_s: float = 120.0) -> int:
    """KV blocks still used, reserved or held once every restarted worker is back and idle."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            cluster.wait_registered(set(cluster.workers), timeout_s=30)
            state = cluster.check_integrity()
            held = sum(w["used_blocks"] + w["reserved"] + w["held"] for w in state["workers"].values())
            if (held == 0 and state["scheduler"]["in_flight"] == 0) or time.monotonic() > deadline:
                return held
        except (ray.exceptions.RayError, TimeoutError, RuntimeError):
            if time.monotonic() > deadline:
                raise
        time.sleep(1.0)


def bench(args: argparse.Namespace) -> dict:
    import openai  # the 'bench' extra: imported here so that `--help` works without it

    config = TandemConfig.from_file(args.config)
    # The scheduler gives a silent worker up after 2 s and a handoff after 5 s (the test suite's values).
    config = config.model_copy(update={"scheduler": config.scheduler.model_copy(
        update={"heartbeat_timeout_s": 2.0, "lease_s": 5.0})})
    engine = Engine(config.engine_config())
    prompts, max_tokens, expected = _workload(args, engine)
    del engine
    hogs = [multiprocessing.Process(target=_burn, daemon=True) for _ in range(args.hog)]
    for h in hogs:
        h.start()
    cluster = Cluster.start(config)
    http = make_server(cluster, "127.0.0.1", 0, IngressSection(request_timeout_s=args.request_timeout_s))
    server = threading.Thread(target=http.run, daemon=True)
    try:
        server.start()
        while not http.started:
            time.sleep(0.05)
        url = f"http://127.0.0.1:{http.servers[0].sockets[0].getsockname()[1]}/v1"
        client = openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=args.request_timeout_s)
        model = served_model_name(cluster)
        started = time.monotonic()
        with _Killer(cluster, args.kill_every_s, args.seed) as killer, ThreadPoolExecutor(args.concurrency) as pool:
            results = list(pool.map(lambda i: _stream(client, model, prompts[i], max_tokens[i]), range(args.requests)))
        seconds = time.monotonic() - started
        kv_after = _kv_after(cluster)
    finally:
        http.should_exit = True
        server.join(timeout=30)
        cluster.shutdown()
        for h in hogs:
            h.kill()
    exact = sum(r.get("text") == want and r.get("finish_reason") == "length" for r, want in zip(results, expected))
    errors = [r["error"] for r in results if "error" in r]
    hung = sum("hung" in r for r in results)
    return {
        "requests": args.requests, "exact": exact, "exact_fraction": exact / args.requests,
        "errors": len(errors), "error_kinds": dict(Counter(e.split(":")[0] for e in errors)), "error_samples": errors[:5],
        "wrong": args.requests - exact - len(errors) - hung, "hung": hung,
        "kills": len(killer.kills), "killed": dict(Counter(killer.kills)), "kill_every_s": args.kill_every_s,
        "hog": args.hog, "concurrency": args.concurrency, "seconds": round(seconds, 1),
        "kv_blocks_after": kv_after, "request_seconds_max": max(r["seconds"] for r in results),
    }
