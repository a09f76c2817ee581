"""Change a live worker's role (prefill <-> decode, into or out of colocated) without reloading its weights.

The worker drains as one being removed does (the scheduler routes nothing new to it, what it serves
finishes there) and the scheduler forgets it; then its process serves on under a new id in the other
pool, with the same loaded engine: only its data-plane ends, command port and registration are new
(`WorkerActor.become`). Its prefix cache is dropped, since the scheduler's index of it went with the old
id. A flip that cannot complete ends as a removal plus a cold start, so the pools reach the sizes asked
for either way; a worker still busy at the drain deadline is stopped as a scale-down stops it (its
requests take the worker-loss path).

Not flipped: tensor-parallel workers (their ranks are built for one role), the collective backend (its
group is fixed at start), and pools whose workers ask different resources (Ray placed the process for
its own pool's CPUs, GPUs and custom resources).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import ray

from cluster.control.config import TandemConfig
from cluster.control.lifecycle.draining import wait_drained
from cluster.control.lifecycle.launch import Cluster, role_of

log = logging.getLogger("tandem.scaling")
_CALL_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class Flip:
    old_id: str
    new_id: str
    drained_s: float  # from the start of the drain until the scheduler forgot the worker
    switched_s: float  # from then until it was registered in its new pool
    cold: bool = False  # the flip failed and a new worker was started instead

    @property
    def total_s(self) -> float:
        return self.drained_s + self.switched_s


def flip_refusal(config: TandemConfig, from_role: str, to_role: str) -> str | None:
    """Why a worker of `from_role` cannot become one of `to_role` in this cluster; None when it can."""
    pools = config.pools()
    for role in (from_role, to_role):
        if role not in pools:
            return f"this cluster has no {role} pool (its pools: {', '.join(pools)})"
    if from_role == to_role:
        return f"the worker already is a {to_role} worker"
    if config.transfer.backend == "collective":
        return "the collective backend's group is fixed at start (transfer.backend zmq flips)"
    a, b = pools[from_role], pools[to_role]
    if a.tensor_parallel_size > 1 or b.tensor_parallel_size > 1:
        return "tensor-parallel workers are built for one role"
    if (a.num_cpus, a.num_gpus, a.resources) != (b.num_cpus, b.num_gpus, b.resources):
        return (f"the {from_role} and {to_role} pools ask different resources per worker (num_cpus, num_gpus, "
                "resources): Ray placed the process for its own pool's")
    return None


def flip(cluster: Cluster, worker_id: str, role: str, drain_timeout_s: float = 600.0,
         ready_timeout_s: float = 300.0) -> Flip:
    """Drain one worker and turn it into a worker of `role`; ValueError when the pools do not allow it."""
    why = flip_refusal(cluster.config, role_of(worker_id), role)
    if why is not None:
        raise ValueError(f"worker {worker_id} cannot become a {role} worker: {why}")
    started = time.monotonic()
    ray.get(cluster.scheduler_of(worker_id).drain.remote(worker_id), timeout=_CALL_TIMEOUT_S)
    return become(cluster, worker_id, role, started, drain_timeout_s, ready_timeout_s)


def become(cluster: Cluster, worker_id: str, role: str, started: float, drain_timeout_s: float,
           ready_timeout_s: float) -> Flip:
    """The part of a flip after the scheduler was told to drain the worker (at `started`, monotonic)."""
    drained = wait_drained(cluster, worker_id, drain_timeout_s)
    drained_at = time.monotonic()
    if drained:
        new_id = cluster.next_id(role)
        try:
            handle = cluster.workers[worker_id]
            threads = cluster.config.pools()[role].torch_threads
            ray.get(handle.become.remote(new_id, role, threads), timeout=ready_timeout_s)
            cluster.rename(worker_id, new_id)
            cluster.wait_registered({new_id}, timeout_s=_CALL_TIMEOUT_S)
            log.info("worker %s is now %s: drained in %.2fs, serving again %.2fs later", worker_id, new_id,
                     drained_at - started, time.monotonic() - drained_at)
            return Flip(worker_id, new_id, drained_at - started, time.monotonic() - drained_at)
        except (ray.exceptions.RayError, TimeoutError) as exc:
            log.warning("worker %s could not become %s (%s): stopping it and starting a new %s worker",
                        worker_id, new_id, exc, role)
            worker_id = new_id if new_id in cluster.workers else worker_id
    else:
        log.warning("worker %s still busy after %.0fs of draining: stopping it and starting a new %s worker "
                    "instead of flipping it", worker_id, drain_timeout_s, role)
    cluster.stop_worker(worker_id)
    new_id = cluster.spawn_worker(role)
    ray.get(cluster.workers[new_id].info.remote(), timeout=ready_timeout_s)
    cluster.wait_registered({new_id}, timeout_s=_CALL_TIMEOUT_S)
    return Flip(worker_id, new_id, drained_at - started, time.monotonic() - drained_at, cold=True)
