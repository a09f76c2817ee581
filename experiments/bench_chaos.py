"""`tandem bench chaos`: SIGKILL a random worker process every few seconds while streams run over HTTP.

What an operator would try: a 2P+2D cluster as configured (heartbeat, lease and progress bounds as
shipped) behind the real HTTP ingress, the official `openai` client streaming greedy requests at a fixed
concurrency, and every `--kill-every-s` a random worker process gets SIGKILL: any `ray::` process of a
prefill or decode worker, one Ray is still restarting included (`--spare-restarting`: only those Ray shows
alive), on a machine kept busy by `--hog` CPU burners. Every request's text is compared with the
single-process engine's. Reported, from one run: how many completed with exactly the fault-free text, how
many ended with an error (and which errors), how many hung (no end within `--request-timeout-s`), the
longest silence of any stream (no chunk, from the request to its first chunk or between two chunks)
against the progress bound, the kills, and the KV still held once the load stopped (must be 0).
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import random
import re
import signal
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import ray

from actors.engine.engine import Engine
from actors.protocol.sampling_params import SamplingParams
from actors.worker.remote import WorkerActor
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
    p.add_argument("--spare-restarting", action="store_true",
                   help="kill only workers Ray shows alive, never a process still starting after a kill")
    p.add_argument("--seed", type=int, default=0)
    add_out_argument(p, "chaos")
    p.set_defaults(func=report_main("chaos", bench, summarize), smoke={"requests": 6, "hog": 0})


def summarize(r: dict) -> str:
    return (f"{r['exact']}/{r['requests']} exact ({r['exact_fraction']:.1%}), {r['errors']} clean errors, "
            f"{r['wrong']} wrong text, {r['hung']} hung, longest silence {r['longest_silence_s']} s (bound "
            f"{r['progress_timeout_s']} s), {r['kills']} SIGKILLs every {r['kill_every_s']} s "
            f"({r['kills_restarting']} of starting processes) with {r['hog']} CPU hogs; a killed worker back after "
            f"{r['worker_back_after_s']['p50']} s (p50), pools with no worker routed to {r['pool_down_fraction']} of the "
            f"run; KV held after: {r['kv_blocks_after']}")


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
    """Every `every_s`, SIGKILL one worker process chosen at random: by default any process of a prefill
    or decode worker, one still starting after an earlier kill included (a crash loop); with
    `spare_restarting`, only those Ray shows alive."""

    def __init__(self, cluster: Cluster, every_s: float, seed: int, spare_restarting: bool):
        self._cluster, self._every_s, self._spare = cluster, every_s, spare_restarting
        self._rng = random.Random(seed)
        self._stop = threading.Event()
        self.kills: list[str] = []
        self.restarting_kills = 0  # of a process Ray did not show alive at the kill (still starting)
        self._down_since: dict[str, float] = {}  # worker id -> when it was killed alive, until Ray shows it alive
        self.back_after_s: list[float] = []
        self.ticks = 0
        self.found_none = 0  # kill times at which no worker process was found: the run proves nothing then
        self.pool_down_ticks = {"prefill": 0, "decode": 0}
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def __enter__(self) -> _Killer:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=60)

    def _loop(self) -> None:
        raylet = _raylet_pid()
        while not self._stop.wait(self._every_s):
            alive = {pid: wid for wid, pid in alive_worker_pids().items()}  # asking a busy worker would wait
            self._observe(self._routed_to())
            victims = alive if self._spare else {pid: alive.get(pid, "starting") for pid in _worker_processes(raylet)}
            pids = sorted(victims)
            self.found_none += not pids
            self._rng.shuffle(pids)
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    continue
                self.kills.append(victims[pid])
                self.restarting_kills += pid not in alive
                if pid in alive:
                    self._down_since.setdefault(alive[pid], time.monotonic())
                break

    def _routed_to(self) -> set[str] | None:
        """The workers the scheduler routes to now (None: it did not answer in time)."""
        try:
            return set(ray.get(self._cluster.scheduler.state.remote(), timeout=5).workers)
        except (ray.exceptions.RayError, TimeoutError):
            return None

    def _observe(self, alive: set[str] | None) -> None:
        """Before each kill: which pools the scheduler has no worker in, and which killed workers are back."""
        if alive is None:
            return
        now = time.monotonic()
        self.ticks += 1
        for pool in ("prefill", "decode"):
            self.pool_down_ticks[pool] += not any(w.startswith(pool) for w in alive)
        for wid in [w for w in self._down_since if w in alive]:
            self.back_after_s.append(now - self._down_since.pop(wid))

    def summary(self) -> dict:
        """How long a killed worker took to be back (the scheduler routes to it again; kills while it started
        count in), and the share of the run the scheduler had no worker of a pool to route to."""
        back = sorted(self.back_after_s)
        return {
            "worker_back_after_s": {"n": len(back), "p50": round(back[len(back) // 2], 1) if back else None,
                                    "max": round(back[-1], 1) if back else None,
                                    "never": len(self._down_since)},
            "pool_down_fraction": {pool: round(n / max(self.ticks, 1), 2) for pool, n in self.pool_down_ticks.items()},
        }


def alive_worker_pids() -> dict[str, int]:
    """Worker id -> process id of every worker Ray shows alive (Ray's GCS actor table; no public API
    gives a process id without calling the actor)."""
    from ray._private import state

    return {a["Name"].removeprefix("tandem-"): a["Pid"] for a in state.actors().values()
            if a.get("Name", "").startswith("tandem-") and a.get("State") == "ALIVE" and a.get("Pid")}


def _raylet_pid() -> int | None:
    """This cluster's raylet: every worker process is its child (the killer spares other Ray instances on
    the box, such as a test session's)."""
    from ray._private import worker

    node = worker._global_node
    raylets = node.all_processes.get("raylet") if node is not None else None
    return raylets[0].process.pid if raylets else None


_WORKER_TITLE = re.compile(rf"ray::(tandem-[\w.-]+:)?{WorkerActor.__name__}\b")


def _worker_processes(raylet: int | None) -> list[int]:
    """Every process of this cluster that Ray titled as a worker actor (`ray::tandem-decode-0:WorkerActor.__init__`
    while it starts, then `ray::WorkerActor.watch`, ...), whatever state Ray shows it in: a restarting worker's
    new process is one before Ray calls it alive. The title follows the actor class's name (a rename once left
    the killer finding nothing: see `_Killer.found_none`)."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            title = (entry / "cmdline").read_bytes().split(b"\0", 1)[0].decode(errors="replace")
            parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if entry.name.isdigit() and _WORKER_TITLE.match(title) and parent == raylet:
            found.append(int(entry.name))
    return found


def _stream(client: openai.OpenAI, model: str, prompt: list[int], max_tokens: int) -> dict:
    import openai

    started = last = time.monotonic()
    text, finish, silence = [], None, 0.0
    try:
        for chunk in client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                               stream=True, extra_body={"ignore_eos": True}):
            now = time.monotonic()
            silence, last = max(silence, now - last), now
            for choice in chunk.choices:
                text.append(choice.text)
                finish = choice.finish_reason or finish
        out = {"text": "".join(text), "finish_reason": finish}
    except openai.APITimeoutError:
        out = {"hung": True}
    except openai.APIError as exc:
        out = {"error": f"{type(exc).__name__}: {exc}"}
    out["seconds"] = round(time.monotonic() - started, 2)
    out["silence_s"] = round(max(silence, time.monotonic() - last), 2)  # an error after a silence counts too
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

    config = TandemConfig.from_file(args.config)  # as given: the bounds a user runs with
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
        with _Killer(cluster, args.kill_every_s, args.seed, args.spare_restarting) as killer, ThreadPoolExecutor(args.concurrency) as pool:
            results = list(pool.map(lambda i: _stream(client, model, prompts[i], max_tokens[i]), range(args.requests)))
        seconds = time.monotonic() - started
        if killer.found_none and not killer.kills:
            raise RuntimeError(f"no worker process was found to kill at any of {killer.found_none} tries: the "
                               "killer's match of the workers' process titles is out of date; this run proves nothing")
        kv_after = _kv_after(cluster)
    finally:
        http.should_exit = True
        server.join(timeout=30)
        cluster.shutdown()
        for h in hogs:
            h.kill()
    exact = sum(r.get("text") == want and r.get("finish_reason") == "length" for r, want in zip(results, expected))
    # An error event after part of the text (finish_reason "error") is a clean error, as long as what came
    # before it is the fault-free text's beginning; anything else that differs is wrong.
    in_stream = [r for r, want in zip(results, expected)
                 if r.get("finish_reason") == "error" and want.startswith(r["text"])]
    wrong = [{"request": i, "finish_reason": r["finish_reason"], "chars": len(r["text"]), "expected_chars": len(want),
              "first_difference": next((j for j, (a, b) in enumerate(zip(r["text"], want)) if a != b),
                                       min(len(r["text"]), len(want)))}
             for i, (r, want) in enumerate(zip(results, expected))
             if "text" in r and not (r["text"] == want and r["finish_reason"] == "length")
             and not (r["finish_reason"] == "error" and want.startswith(r["text"]))]
    errors = [r["error"] for r in results if "error" in r] + ["finish_reason error mid-stream"] * len(in_stream)
    hung = sum("hung" in r for r in results)
    return {
        "requests": args.requests, "exact": exact, "exact_fraction": exact / args.requests,
        "errors": len(errors), "error_kinds": dict(Counter(e.split(":")[0] for e in errors)), "error_samples": errors[:5],
        "wrong": len(wrong), "wrong_samples": wrong[:10], "hung": hung,
        "longest_silence_s": max(r["silence_s"] for r in results),
        "progress_timeout_s": config.scheduler.progress_timeout_s,
        "silent_past_bound": sum(r["silence_s"] > config.scheduler.progress_timeout_s for r in results),
        "kills": len(killer.kills), "killed": dict(Counter(killer.kills)), "kill_every_s": args.kill_every_s,
        "kills_restarting": killer.restarting_kills, **killer.summary(),
        "hog": args.hog, "concurrency": args.concurrency, "seconds": round(seconds, 1),
        "kv_blocks_after": kv_after, "request_seconds_max": max(r["seconds"] for r in results),
    }
