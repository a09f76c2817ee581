"""The worker as Ray sees it: a thin actor class whose methods hand over to `Worker` (actor.py).

Every process that holds a worker's handle loads the handle's class: the scheduler does when a worker
registers, on its event loop. This class imports nothing heavy; torch, the engine and the model load
only in the worker's own process, when it is constructed. (With `Worker` itself as the actor class, the
first registration stalled every scheduler start and restart for ~3 s while it imported torch,
measured on this box: every admission waited behind it.)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import ray

if TYPE_CHECKING:
    from actors.protocol.messages import WorkerInfo, WorkerStats
    from actors.worker.spec import WorkerSpec
    from actors.worker.step_log import StepRecord


class WorkerActor:
    def __init__(self, spec: WorkerSpec, scheduler=None):
        from actors.worker import identity
        from actors.worker.actor import Worker

        self._scheduler = scheduler
        self._worker = Worker(identity.current(spec), scheduler)  # after a flip, restarted as what it became

    def become(self, worker_id: str, role: str, torch_threads: int) -> WorkerInfo:
        """A role flip: this process, drained and forgotten by the scheduler under its old id, serves on as
        a new worker with the same engine (no weights reloaded); it registers itself in its new pool."""
        from actors.worker import identity
        from actors.worker.actor import Worker

        became = identity.Became(worker_id, role, torch_threads)
        engine = self._worker.hand_over()
        self._worker = Worker(became.applied(self._worker.spec), self._scheduler, engine)
        identity.remember(became)
        return self._worker.info()

    def info(self) -> WorkerInfo:
        return self._worker.info()

    def tensor_parallel_ranks(self) -> list:
        return self._worker.tensor_parallel_ranks()

    def drain_estimate_s(self) -> float:
        return self._worker.drain_estimate_s()

    def step_log(self, since: int = 0) -> tuple[int, list[StepRecord]]:
        return self._worker.step_log(since)

    def kv_bytes(self) -> tuple[int, int]:
        return self._worker.kv_bytes()

    def inject_fault(self, fault: str | None, delay_s: float = 1.0) -> None:
        self._worker.inject_fault(fault, delay_s)

    def check_integrity(self) -> WorkerStats:
        return self._worker.check_integrity()

    @ray.method(concurrency_group="watch")
    def watch(self, worker_id: str | None = None) -> None:
        self._worker.watch(worker_id)

    @ray.method(concurrency_group="watch")
    def incarnation(self, worker_id: str | None = None) -> str:
        return self._worker.incarnation(worker_id)

    def shutdown(self) -> None:
        self._worker.shutdown()


def worker_actor():
    """The worker's Ray actor class: "watch" and "incarnation" run in a thread group of their own."""
    return ray.remote(concurrency_groups={"watch": 2})(WorkerActor)  # the pending watch, and probes
