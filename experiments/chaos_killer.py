"""The chaos killer of `tandem bench chaos`: every few seconds a SIGKILL to one worker process of this
cluster, chosen at random, one Ray is still restarting included (a crash loop) unless told to spare those;
and what it saw meanwhile (kills, kills of starting processes, how long a killed worker took to be routed
to again, how often a pool had no worker). Processes are found without calling the workers (a busy or
stopped worker would not answer): Ray's actor table for the live ones, /proc for every one.
"""

from __future__ import annotations

import os
import random
import re
import signal
import threading
import time
from pathlib import Path

import ray

from actors.worker.remote import WorkerActor
from cluster.control.lifecycle.launch import Cluster


class Killer:
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

    def __enter__(self) -> Killer:
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
