"""Resize the pools of a running cluster: new workers register and take work; removed ones drain.

Scale-down never fails a request: the scheduler stops routing to the chosen workers, their
in-flight requests finish where they are, and only then is each worker forgotten and stopped. A
worker that still has work at the drain deadline is stopped anyway, and its requests take the
ordinary worker-loss path (re-route or migration).
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

import ray

from cluster.control.config import TandemConfig
from cluster.control.lifecycle.draining import wait_drained
from cluster.control.lifecycle.launch import Cluster, role_of, worker_index
from cluster.control.lifecycle.periodic import Periodic
from cluster.control.lifecycle.role_flip import become, flip_refusal

log = logging.getLogger("tandem.scaling")
_resizing = threading.Lock()


class ResizeInProgress(RuntimeError):
    pass


def scale(cluster: Cluster, replicas: dict[str, int], ready_timeout_s: float = 300.0,
          drain_timeout_s: float = 600.0, flips: bool = False, wait: bool = True) -> dict:
    """Bring each named pool to its replica count; returns {"added": [...], "removed": [...], "flipped":
    [...], "replicas": {...}}. `flips`: where one pool shrinks and another grows, the shrinking pool's
    workers change role (role_flip.py) instead of some stopping and others starting cold.

    `wait=False` (the autoscaler's) returns once the flips are done and everything else is under way: new
    workers start and removed ones drain in a thread, and the next resize may come meanwhile (it counts a
    starting worker as serving and a draining one as gone; it may not shrink a pool while one of its
    workers is still starting: ResizeInProgress). The replica counts are the target then, and fall back if
    a new worker fails to start."""
    if not _resizing.acquire(blocking=False):
        raise ResizeInProgress("a resize is already in progress")
    try:
        result, rest = _scale(cluster, replicas, ready_timeout_s, drain_timeout_s, flips)
    finally:
        _resizing.release()
    if not wait:
        threading.Thread(target=_logged(rest), name="tandem-resize-finish", daemon=True).start()
        return result
    error = rest()
    if error is not None:
        raise error
    return {**result, "replicas": {role: _count(cluster, role) for role in cluster.config.pools()}}


def _scale(cluster: Cluster, replicas: dict[str, int], ready_timeout_s: float, drain_timeout_s: float,
           flips: bool):
    """The part of a resize nothing else may interleave with: validate, pick, spawn, tell the leaving workers
    to drain, flip. Returns the result and the rest (new workers' start, removed ones' drain) to run after."""
    pools = cluster.config.pools()
    for role, n in replicas.items():
        if role not in pools:
            raise ValueError(f"this cluster has no {role} pool (its pools: {', '.join(pools)})")
        least = 0 if role == "prefill" else 1  # with no prefill pool, decode workers prefill locally
        if n < least:
            raise ValueError(f"{role} replicas must be at least {least}, got {n}")
        if n > pools[role].max_replicas:
            raise ValueError(f"{role} replicas must be at most {pools[role].max_replicas} (its max_replicas), got {n}")
    if cluster.config.transfer.backend == "collective" and any(n != _count(cluster, r) for r, n in replicas.items()):
        raise ValueError("live scaling needs transfer.backend zmq: the collective group's size is fixed at start")
    state = cluster.resizes
    with state.lock:
        for role, n in replicas.items():
            starting = sorted(wid for wid in state.starting if role_of(wid) == role)
            if starting and n < _count(cluster, role):
                raise ResizeInProgress(f"{', '.join(starting)} still starting: the {role} pool shrinks once its "
                                       "new workers serve")
    moves = _flips(cluster, replicas) if flips else []
    flipping = {wid for wid, _ in moves}
    added, removed = [], []
    spawned = time.monotonic()
    with state.lock:
        for role, n in replicas.items():
            arriving = sum(1 for _, to in moves if to == role)
            for _ in range(n - _count(cluster, role) - arriving):
                added.append(cluster.spawn_worker(role))
                state.starting.add(added[-1])
            leaving = [wid for wid in _removable(cluster, role) if wid not in flipping]
            removed += leaving[:max(_count(cluster, role) - sum(1 for wid in flipping if role_of(wid) == role) - n, 0)]
        state.leaving.update(removed)
    # Everything that leaves stops taking work now, and the flips go ahead while the new workers load their
    # weights: a flip is quick by choice (it drains before a cold start would end), so a resize that also
    # starts workers cold does not hold it back until they are ready.
    started = time.monotonic()
    try:
        for wid in removed + [wid for wid, _ in moves]:
            ray.get(cluster.scheduler_of(wid).drain.remote(wid), timeout=30)
        flipped = [become(cluster, wid, role, started, drain_timeout_s, ready_timeout_s) for wid, role in moves]
    except BaseException:
        _finish(cluster, added, removed, spawned, ready_timeout_s, drain_timeout_s)
        raise
    _recount(cluster)
    log.info("scaling: adding %s, removing %s, flipped %s", added or "none", removed or "none",
             [f"{f.old_id} -> {f.new_id}" for f in flipped] or "none")
    result = {"added": added, "removed": removed,
              "flipped": [{"from": f.old_id, "to": f.new_id, "seconds": round(f.total_s, 3), "cold": f.cold,
                           "drained_s": round(f.drained_s, 3), "switched_s": round(f.switched_s, 3)} for f in flipped],
              "replicas": {role: _count(cluster, role) for role in cluster.config.pools()}}
    return result, lambda: _finish(cluster, added, removed, spawned, ready_timeout_s, drain_timeout_s)


def _finish(cluster: Cluster, added: list[str], removed: list[str], spawned: float, ready_timeout_s: float,
            drain_timeout_s: float) -> ValueError | None:
    """Wait for the new workers (stopping any that did not start) and for the removed ones to drain, then stop
    those; the error of a failed start, or None."""
    state = cluster.resizes
    error = None
    try:
        if added:
            try:
                _wait_ready(cluster, added, ready_timeout_s)
                cluster.worker_start_s = time.monotonic() - spawned
            except ValueError as exc:
                error = exc
            finally:  # started, stopped or failed otherwise: no longer what a resize waits for
                with state.lock:
                    state.starting.difference_update(added)
    finally:
        for wid in removed:  # told to drain together: each is waited for in turn
            _drain_and_stop(cluster, wid, drain_timeout_s)
        _recount(cluster)
    log.info("scaled: added %s, removed %s%s", added or "none", removed or "none",
             f" ({error})" if error else "")
    return error


def _logged(rest):
    """The rest of a resize nobody waits for: what goes wrong there is logged (the cluster serves on at the
    size it reached; the pools' counts are what is there)."""
    def run() -> None:
        try:
            rest()
        except Exception:
            log.exception("a resize's new workers or drains failed")
    return run


def _recount(cluster: Cluster) -> None:
    with cluster.resizes.lock:
        cluster.config = _with_replicas(cluster.config, {role: _count(cluster, role) for role in cluster.config.pools()})


def _flips(cluster: Cluster, replicas: dict[str, int]) -> list[tuple[str, str]]:
    """(worker, new role) pairs: the workers a shrinking pool gives up (its highest ids, as a removal picks)
    that a growing pool can take by a flip, each only if its drain may end before a cold start would
    (a decode worker holding long answers is slower to free than a new worker is to start)."""
    leaving = {role: _removable(cluster, role)[:max(_count(cluster, role) - n, 0)][::-1] for role, n in replicas.items()}
    short = {role: n - _count(cluster, role) for role, n in replicas.items() if n > _count(cluster, role)}
    moves = []
    for to_role, need in short.items():
        for from_role, victims in leaving.items():
            while need and victims and flip_refusal(cluster.config, from_role, to_role) is None:
                wid = victims.pop()
                if _drains_before_a_cold_start(cluster, wid):
                    moves.append((wid, to_role))
                    need -= 1
    return moves


def _drains_before_a_cold_start(cluster: Cluster, worker_id: str) -> bool:
    if cluster.worker_start_s is None:
        return True
    try:
        drain_s = ray.get(cluster.workers[worker_id].drain_estimate_s.remote(), timeout=30)
    except ray.exceptions.RayError as exc:
        log.warning("worker %s: no drain estimate (%s): it stops instead of flipping", worker_id, exc)
        return False
    if drain_s < cluster.worker_start_s:
        return True
    log.info("worker %s may take %.1fs to drain, a cold start %.1fs: it stops, and a new worker starts",
             worker_id, drain_s, cluster.worker_start_s)
    return False


def _wait_ready(cluster: Cluster, worker_ids: list[str], timeout_s: float) -> None:
    try:
        ray.get([cluster.workers[w].info.remote() for w in worker_ids], timeout=timeout_s)
        cluster.wait_registered(set(worker_ids), timeout_s=30.0)
    except (ray.exceptions.GetTimeoutError, TimeoutError):
        with cluster.resizes.lock:
            for wid in worker_ids:  # never leave a half-added worker behind
                cluster.stop_worker(wid)
                cluster.resizes.starting.discard(wid)
        raise ValueError(f"new workers {worker_ids} were not ready within {timeout_s:.0f}s: does the Ray cluster "
                         "have the CPUs/GPUs/resources their pool asks for?") from None


def _drain_and_stop(cluster: Cluster, worker_id: str, timeout_s: float) -> None:
    """Whatever the drain or the shutdown call meets, the worker is stopped and forgotten as leaving."""
    try:
        if not wait_drained(cluster, worker_id, timeout_s):
            log.warning("worker %s still busy after %.0fs of draining: stopping it anyway", worker_id, timeout_s)
        ray.get(cluster.workers[worker_id].shutdown.remote(), timeout=30)
    except (ray.exceptions.RayError, TimeoutError) as exc:
        log.warning("worker %s drain or shutdown: %s", worker_id, exc)
    finally:
        with cluster.resizes.lock:
            cluster.stop_worker(worker_id)
            cluster.resizes.leaving.discard(worker_id)


def _ids(cluster: Cluster, role: str) -> list[str]:
    """The pool's members: its workers less those leaving (starting ones count: they will serve)."""
    leaving = cluster.resizes.leaving
    return [wid for wid in list(cluster.workers) if role_of(wid) == role and wid not in leaving]


def _removable(cluster: Cluster, role: str) -> list[str]:
    """Members a shrink may take, the newest first (never one still starting: a pool with one is refused a
    shrink, see `_scale`)."""
    starting = cluster.resizes.starting
    return sorted((wid for wid in _ids(cluster, role) if wid not in starting), key=worker_index, reverse=True)


def _count(cluster: Cluster, role: str) -> int:
    return len(_ids(cluster, role))


def _with_replicas(config: TandemConfig, replicas: dict[str, int]) -> TandemConfig:
    update = {role: getattr(config, role).model_copy(update={"replicas": n}) for role, n in replicas.items()}
    return config.model_copy(update=update)


def replicas_change(old: TandemConfig, new: TandemConfig) -> dict[str, int]:
    """The pool sizes a config edit asks for; ValueError if it changes anything a live cluster can't."""
    def without_replicas(config: TandemConfig) -> dict:
        dump = config.model_dump()
        for role in ("prefill", "decode", "colocated"):
            dump[role].pop("replicas", None)
        return dump

    if without_replicas(old) != without_replicas(new):
        raise ValueError("only the pools' replicas can change on a running cluster; restart `tandem serve` "
                         "for any other change")
    return {role: pool.replicas for role, pool in new.pools().items()
            if pool.replicas != old.pools()[role].replicas}


class ConfigWatcher:
    """Applies edits of the pools' replicas in the config file `tandem serve` runs from."""

    def __init__(self, cluster: Cluster, path: str | Path, interval_s: float = 2.0):
        self.cluster, self.path = cluster, Path(path)
        self._mtime = self.path.stat().st_mtime
        # A bad edit is reported and ignored; the cluster keeps serving.
        self._loop = Periodic("tandem-config-watch", interval_s, self._check,
                              lambda exc: log.error("config %s: not applied: %s", self.path, exc))

    def start(self) -> "ConfigWatcher":
        self._loop.start()
        return self

    def stop(self) -> None:
        self._loop.stop()

    def _check(self) -> None:
        mtime = self.path.stat().st_mtime
        if mtime == self._mtime:
            return
        self._mtime = mtime
        change = replicas_change(self.cluster.config, TandemConfig.from_file(self.path))
        if change:
            log.info("config %s changed: resizing to %s", self.path, change)
            scale(self.cluster, change)
