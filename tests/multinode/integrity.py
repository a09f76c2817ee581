"""Run on a host of the namespaced cluster (`netns_cluster.sh run head python -m tests.multinode.integrity`):
joins its Ray cluster, checks the scheduler's and every reachable worker's integrity (a worker on a dead
host is left out: under load the scheduler may still list it), prints one JSON line
{"scheduler": state, "workers": {id: stats}} (the caller decides what must be zero)."""

from __future__ import annotations

import json

import ray

from cluster.control.lifecycle.launch import NAMESPACE, SCHEDULER_NAME


def main() -> None:
    ray.init(address="auto", namespace=NAMESPACE, log_to_driver=False)
    scheduler = ray.get_actor(SCHEDULER_NAME, namespace=NAMESPACE)
    state = ray.get(scheduler.check_integrity.remote(), timeout=60)
    stats = {}
    for wid in state.workers:
        try:
            s = ray.get(ray.get_actor(f"tandem-{wid}", namespace=NAMESPACE).check_integrity.remote(), timeout=60)
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError, ValueError):
            continue  # its host is gone (or Ray is restarting it elsewhere): left out, the caller sees it missing
        stats[s.worker_id] = s.as_dict()
    print(json.dumps({"scheduler": state.as_dict(), "workers": stats}, default=str))


if __name__ == "__main__":
    main()
