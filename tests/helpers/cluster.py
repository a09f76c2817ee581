"""Cluster test helpers: the committed configs with test-sized KV, a mixed greedy workload, and a wait
for every worker and the scheduler to be idle with their integrity checked."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import torch

from actors.protocol.sampling_params import SamplingParams
from cluster.control.config import TandemConfig
from cluster.control.launch import Cluster

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


def wait_until_idle(cluster: Cluster, timeout_s: float = 10.0) -> dict:
    """Integrity of every worker and the scheduler once the last reports are in."""
    deadline = time.monotonic() + timeout_s
    while True:
        state = cluster.check_integrity()
        workers = state["workers"].values()
        idle = state["scheduler"]["in_flight"] == 0 and all(
            w["reserved"] == 0 and w["held"] == 0 and w["live_requests"] == 0 and w["used_blocks"] == 0 for w in workers
        )
        if idle or time.monotonic() > deadline:
            return state
        time.sleep(0.05)


def generate_in_background(cluster: Cluster, prompts, params, timeout_s: float = 240.0) -> tuple[threading.Thread, dict]:
    """Run the requests from a thread (a test meanwhile breaks something); `out["got"]` holds the results
    once the thread has ended."""
    client, out = cluster.client(), {}
    runner = threading.Thread(target=lambda: out.update(got=client.generate(prompts, params, timeout_s=timeout_s)))
    runner.start()
    return runner, out


class ClosedLoop:
    """Closed-loop greedy requests from a few threads (a test resizes the pools meanwhile); every result is
    checked against `expected`, the engine's tokens for the same prompt. `bad` lists what went wrong."""

    def __init__(self, cluster: Cluster, prompts, params, expected: list[list[int]], threads: int = 4):
        self.client, self.prompts, self.params, self.expected = cluster.client(), prompts, params, expected
        self.done, self.bad = 0, []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(i, threads), daemon=True) for i in range(threads)]
        for t in self._threads:
            t.start()

    def _run(self, k: int, stride: int) -> None:
        i, n = k, len(self.prompts)
        while not self._stop.is_set():
            try:
                (r,) = self.client.generate([self.prompts[i % n]], self.params, timeout_s=120)[0]
                ok = r.finish_reason == "length" and r.token_ids == self.expected[i % n]
                self.bad += [] if ok else [r.error or "wrong tokens"]
            except Exception as exc:
                self.bad.append(f"{type(exc).__name__}: {exc}")
            self.done += 1
            i += stride

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=120)
