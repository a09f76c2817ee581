"""Run on a host of the namespaced cluster (`netns_cluster.sh run head python -m tests.multinode.integrity`):
joins its Ray cluster, checks the scheduler's and every live worker's integrity, prints one JSON line
{"scheduler": state, "workers": {id: stats}} (the caller decides what must be zero)."""

from __future__ import annotations

import json

import ray

from cluster.control.launch import NAMESPACE, SCHEDULER_NAME


def main() -> None:
    ray.init(address="auto", namespace=NAMESPACE, log_to_driver=False)
    scheduler = ray.get_actor(SCHEDULER_NAME, namespace=NAMESPACE)
    state = ray.get(scheduler.check_integrity.remote(), timeout=60)
    workers = {wid: ray.get_actor(f"tandem-{wid}", namespace=NAMESPACE) for wid in state.workers}
    stats = ray.get([w.check_integrity.remote() for w in workers.values()], timeout=60)
    print(json.dumps({"scheduler": state.as_dict(), "workers": {s.worker_id: s.as_dict() for s in stats}},
                     default=str))


if __name__ == "__main__":
    main()
