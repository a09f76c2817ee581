"""Wait for a draining worker to finish what it serves and for the scheduler to forget it: the common
part of removing a worker (scaling.py) and flipping its role (role_flip.py)."""

from __future__ import annotations

import time

import ray

from cluster.control.lifecycle.launch import Cluster

_CALL_TIMEOUT_S = 30.0


def wait_drained(cluster: Cluster, worker_id: str, timeout_s: float) -> bool:
    """After `scheduler.drain(worker_id)`: True once the worker holds nothing and the scheduler has forgotten
    it (no request involves it any more); False if that did not happen within `timeout_s`."""
    handle = cluster.workers[worker_id]
    deadline = time.monotonic() + timeout_s
    while not _idle(handle) or not ray.get(cluster.scheduler_of(worker_id).remove.remote(worker_id),
                                           timeout=_CALL_TIMEOUT_S):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def _idle(handle) -> bool:
    stats = ray.get(handle.check_integrity.remote(), timeout=_CALL_TIMEOUT_S)
    return stats.live_requests == stats.reserved == stats.held == 0
