"""A fleet of simulated workers behind the real scheduler actor, in the current Ray instance: what
`tandem bench control-plane` and the fleet tests start."""

from __future__ import annotations

import time
from dataclasses import dataclass

import ray

from cluster.control.scheduler.actor import Scheduler
from cluster.control.scheduler.scheduler_state import SchedulerSettings
from experiments.fleet.sim_host import SimHost
from experiments.fleet.sim_worker import SimSpec

MODEL_ID = "sim"


def fleet_settings(heartbeat_timeout_s: float = 10.0, queue_timeout_s: float = 5.0) -> SchedulerSettings:
    return SchedulerSettings(
        mode="disaggregated", routing="cache_aware", block_size=SimSpec.block_size, model_id=MODEL_ID,
        reserve="prompt_plus_max_tokens", max_queued=1_000_000, queue_timeout_s=queue_timeout_s,
        local_prefill=False, local_prefill_penalty=1.0, prefill_s_per_token=1e-5, transfer_bytes_per_s=10e9,
        heartbeat_timeout_s=heartbeat_timeout_s)


@dataclass
class Fleet:
    schedulers: list  # the scheduler shards (one, unless started with more)
    hosts: list  # SimHost actor handles
    workers: dict[str, tuple[int, str]]  # worker id -> (host index, role)

    @property
    def scheduler(self):
        return self.schedulers[0]

    @classmethod
    def start(cls, num_workers: int, per_host: int | tuple[int, ...] = 64, spec: SimSpec | None = None,
              settings: SchedulerSettings | None = None, timeout_s: float = 300.0, restartable: bool = False,
              shards: int = 1) -> Fleet:
        """Half prefill, half decode workers (at least one of each per shard), `per_host` to a process (or
        each host's own count, in order). `restartable`: Ray restarts a scheduler when it dies, as a real
        cluster's (which then rebuilds from the workers). `shards`: scheduler actors, each with its own
        share of each pool. If the fleet does not come up, nothing it started is left running."""
        if num_workers < 2 * shards:
            raise ValueError("a fleet needs at least one prefill and one decode worker per scheduler shard")
        sizes = _host_sizes(num_workers, per_host)
        spec = spec or SimSpec()
        schedulers = [ray.remote(Scheduler).options(num_cpus=0, max_restarts=-1 if restartable else 0).remote(
            settings or fleet_settings()) for _ in range(shards)]
        # Interleaved roles (every host has both) and shards (every shard has both roles, on every host).
        names = [(f"sim-{'p' if i % 2 == 0 else 'd'}{i}", "prefill" if i % 2 == 0 else "decode", (i // 2) % shards)
                 for i in range(num_workers)]
        starts = [sum(sizes[:i]) for i in range(len(sizes))]
        groups = [names[start:start + size] for start, size in zip(starts, sizes)]
        hosts = [ray.remote(SimHost).options(num_cpus=0).remote(group, spec, schedulers, MODEL_ID) for group in groups]
        fleet = cls(schedulers, hosts, {wid: (i, role) for i, group in enumerate(groups) for wid, role, _ in group})
        try:
            ray.get([h.start.remote() for h in hosts], timeout=timeout_s)
            fleet.wait_registered(set(fleet.workers), timeout_s)
        except BaseException:
            fleet.shutdown()
            raise
        return fleet

    def wait_registered(self, worker_ids: set[str], timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            known = {wid for state in self.states(timeout_s) for wid in state.workers}
            if worker_ids <= known:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"{len(worker_ids - known)} simulated workers never registered")
            time.sleep(0.2)

    def kill(self, worker_ids: list[str]) -> None:
        """Simulated crashes: the workers stop at once, their hosts live on."""
        by_host: dict[int, list[str]] = {}
        for wid in worker_ids:
            by_host.setdefault(self.workers[wid][0], []).append(wid)
        ray.get([self.hosts[i].kill.remote(ids) for i, ids in by_host.items()], timeout=30)

    def kill_host(self, index: int) -> list[str]:
        """A real process death: every worker the host held."""
        ray.kill(self.hosts[index], no_restart=True)
        return [wid for wid, (i, _) in self.workers.items() if i == index]

    def check_integrity(self, dead_hosts: set[int] = frozenset(), timeout_s: float = 30.0) -> list[dict]:
        """Every live host's workers' block accounting, then the scheduler's own checks."""
        hosts = ray.get([h.check_integrity.remote() for i, h in enumerate(self.hosts) if i not in dead_hosts],
                        timeout=timeout_s)
        ray.get([s.check_integrity.remote() for s in self.schedulers], timeout=timeout_s)
        return hosts

    def states(self, timeout_s: float = 30.0) -> list:
        return ray.get([s.state.remote() for s in self.schedulers], timeout=timeout_s)

    def shutdown(self) -> None:
        for actor in [*self.hosts, *self.schedulers]:
            ray.kill(actor, no_restart=True)


def _host_sizes(num_workers: int, per_host: int | tuple[int, ...]) -> list[int]:
    if isinstance(per_host, int):
        if per_host < 1:
            raise ValueError(f"per_host must be at least 1, got {per_host}")
        return [min(per_host, num_workers - start) for start in range(0, num_workers, per_host)]
    if sum(per_host) != num_workers or min(per_host) < 1:
        raise ValueError(f"host sizes {per_host} must be positive and add up to {num_workers} workers")
    return list(per_host)
