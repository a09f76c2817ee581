"""Cluster test helpers: the committed configs with test-sized KV, a mixed greedy workload, and a wait
for every worker and the scheduler to be idle with their integrity checked. Every wait here fails, naming
what it still waits for, when its deadline runs out."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import ray
import torch

from actors.protocol.sampling_params import SamplingParams
from cluster.control.config import TandemConfig
from cluster.control.lifecycle.launch import Cluster
from cluster.frontend.open_client import open_client

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def load(name: str, **engine) -> TandemConfig:
    """A config of configs/ for tests; `+collective` uses that transport, `+2shards` two scheduler shards,
    `+overlap` overlapped engine steps (on the CPU only their order: see actors/engine/in_flight.py)."""
    backend, shards = "zmq", 1
    if name.endswith("+overlap"):
        name, engine = name.removesuffix("+overlap"), {"overlap_steps": True, **engine}
    if name.endswith("+collective"):
        name, backend = name.removesuffix("+collective"), "collective"
    if name.endswith("+2shards"):
        name, shards = name.removesuffix("+2shards"), 2
    config = TandemConfig.from_file(CONFIGS / name)
    return config.model_copy(update={
        "engine": config.engine.model_copy(update={"num_kv_blocks": 512, **engine}),
        "transfer": config.transfer.model_copy(update={"backend": backend}),
        "scheduler": config.scheduler.model_copy(update={"shards": shards}),
    })


def workload(n: int = 32):
    g = torch.Generator().manual_seed(11)
    system = torch.randint(10, 2048, (40,), generator=g).tolist()  # a repeated system prompt: cache hits
    prompts, params = [], []
    for i in range(n):
        length = [3, 7, 15, 16, 17, 33, 64, 90][i % 8]  # shorter than, equal to and across blocks of 16
        own = torch.randint(10, 2048, (length,), generator=g).tolist()
        prompts.append(system + own if i % 3 == 0 else own)
        params.append(SamplingParams(temperature=0.0, max_tokens=4 + (i * 7) % 24, ignore_eos=True))
    return prompts, params


def wait_until_resized(cluster: Cluster, timeout_s: float = 120.0) -> None:
    """Until no resize waits for a worker to start or to drain (`scale(..., wait=False)` returns before)."""
    deadline = time.monotonic() + timeout_s
    while cluster.resizes.starting or cluster.resizes.leaving:
        assert time.monotonic() < deadline, (f"still starting {sorted(cluster.resizes.starting)}, "
                                             f"leaving {sorted(cluster.resizes.leaving)}")
        time.sleep(0.05)


# What an idle worker holds: nothing reserved, held, running or allocated.
IDLE_WORKER_FIELDS = ("reserved", "held", "live_requests", "used_blocks")
# Long enough for the last reports (a heartbeat), a lease and a migration's reclaim on a busy 2-core box; a
# longer wait only waits for the state, it never lets a leak through: the wait fails if the state never comes.
IDLE_TIMEOUT_S = 60.0


def wait_restarted(cluster: Cluster, worker_id: str, timeout_s: float = 120.0) -> str:
    """The incarnation of `worker_id`'s process once it answers again and the scheduler has registered that
    process (a worker Ray is restarting refuses calls; the scheduler may still list the dead one)."""
    deadline = time.monotonic() + timeout_s
    handle = cluster.workers[worker_id]
    while True:
        assert time.monotonic() < deadline, f"{worker_id} was not back and registered within {timeout_s}s"
        try:
            incarnation = ray.get(handle.incarnation.remote(), timeout=10)
            known = ray.get(cluster.scheduler_of(worker_id).state.remote(), timeout=10).incarnations.get(worker_id)
        except ray.exceptions.RayError:  # restarting, or a call that timed out on a busy box
            time.sleep(0.2)
            continue
        if known == incarnation:
            return incarnation
        time.sleep(0.05)


def still_held(state: dict) -> list[str]:
    """What a `check_integrity()` report still holds, one line per holder ([] when all is idle)."""
    held = [f"scheduler: in_flight={state['scheduler']['in_flight']}"] if state["scheduler"]["in_flight"] else []
    for worker_id, stats in sorted(state["workers"].items()):
        busy = {name: stats[name] for name in IDLE_WORKER_FIELDS if stats[name]}
        if busy:
            held.append(f"{worker_id}: " + ", ".join(f"{name}={n}" for name, n in busy.items()))
    return held


def wait_until_idle(cluster: Cluster, timeout_s: float = IDLE_TIMEOUT_S) -> dict:
    """Waits until the scheduler has nothing in flight and no worker reserves, holds, runs or allocates
    anything, every owner's integrity checked on each look; returns that idle report. Fails (AssertionError)
    naming what is still held when `timeout_s` runs out."""
    deadline = time.monotonic() + timeout_s
    while True:
        state = cluster.check_integrity()
        held = still_held(state)
        if not held:
            return state
        assert time.monotonic() < deadline, f"not idle after {timeout_s:g} s, still held: " + "; ".join(held)
        time.sleep(0.05)


# What only grows in a worker's stats with its handoffs: the scheduler's copy (from the worker's last report)
# equals the worker's own once a report sent after its last handoff has arrived.
HANDOFF_COUNTS = ("transfers_sent", "adopted")


def wait_until_reported(cluster: Cluster, timeout_s: float = IDLE_TIMEOUT_S) -> dict:
    """`wait_until_idle`, then until the scheduler has every worker's report of its last handoff. A worker's
    KV events ride its reports (with the stats of the same moment), so the prefix index then knows every
    block computed so far: the decode worker's finish report (idle) carries those of a prompt it computed,
    the prefill worker's report of the transfer those of one it computed. Fails naming who is behind."""
    deadline = time.monotonic() + timeout_s
    while True:
        state = wait_until_idle(cluster, max(deadline - time.monotonic(), 0.0))
        heard = state["scheduler"]["worker_stats"]
        behind = {wid: {name: (heard.get(wid, {}).get(name), own[name]) for name in HANDOFF_COUNTS}
                  for wid, own in state["workers"].items()
                  if any(heard.get(wid, {}).get(name) != own[name] for name in HANDOFF_COUNTS)}
        if not behind:
            return state
        assert time.monotonic() < deadline, f"the scheduler has not heard the workers' latest reports: {behind}"
        time.sleep(0.05)


def generate_in_background(cluster: Cluster, prompts, params, timeout_s: float = 240.0) -> tuple[threading.Thread, dict]:
    """Run the requests from a thread (a test meanwhile breaks something); `out["got"]` holds the results
    once the thread has ended."""
    client, out = open_client(cluster), {}
    runner = threading.Thread(target=lambda: out.update(got=client.generate(prompts, params, timeout_s=timeout_s)))
    runner.start()
    return runner, out


class ClosedLoop:
    """Closed-loop greedy requests from a few threads (a test resizes the pools meanwhile); every result is
    checked against `expected`, the engine's tokens for the same prompt. `bad` lists what went wrong."""

    def __init__(self, cluster: Cluster, prompts, params, expected: list[list[int]], threads: int = 4):
        self.client, self.prompts, self.params, self.expected = open_client(cluster), prompts, params, expected
        self.done, self.bad = 0, []
        self._stop, self._lock = threading.Event(), threading.Lock()
        self._threads = [threading.Thread(target=self._run, args=(i, threads), daemon=True) for i in range(threads)]
        for t in self._threads:
            t.start()

    def _run(self, k: int, stride: int) -> None:
        i, n = k, len(self.prompts)
        while not self._stop.is_set():
            try:
                (r,) = self.client.generate([self.prompts[i % n]], self.params, timeout_s=120)[0]
                ok = r.finish_reason == "length" and r.token_ids == self.expected[i % n]
                wrong = [] if ok else [r.error or "wrong tokens"]
            except Exception as exc:
                wrong = [f"{type(exc).__name__}: {exc}"]
            with self._lock:
                self.bad += wrong
                self.done += 1
            i += stride

    def wait_done(self, n: int, timeout_s: float = 120.0) -> None:
        """Until `n` requests in all have ended (the load is flowing); fails with the count and what went wrong."""
        deadline = time.monotonic() + timeout_s
        while self.done < n:
            assert time.monotonic() < deadline, f"only {self.done} of {n} requests ended in {timeout_s:g} s: {self.bad[:3]}"
            time.sleep(0.05)

    def stop(self, timeout_s: float = 150.0) -> None:
        """Stops the loop and waits for its threads; fails naming the ones still running after `timeout_s`
        (a request in flight ends within its own 120 s deadline: a thread alive past that is a hang)."""
        self._stop.set()
        deadline = time.monotonic() + timeout_s
        for t in self._threads:
            t.join(timeout=max(0.0, deadline - time.monotonic()))
        running = [t.name for t in self._threads if t.is_alive()]
        assert not running, f"closed-loop threads still running after {timeout_s:g} s: {running} ({self.done} done)"


def collect_tokens(client, handle, timeout_s: float = 300.0) -> list[int]:
    """A submitted request's tokens through the cluster client; any error event fails the test."""
    tokens = []
    for event in client.events(handle, timeout_s=timeout_s):
        assert event.error is None, event.error
        tokens += event.token_ids
    return tokens
