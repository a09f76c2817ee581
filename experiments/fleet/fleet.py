"""A fleet of simulated workers behind the real scheduler actor, in the current Ray instance: what
`tandem bench control-plane` and the fleet tests start."""

from __future__ import annotations

import time
from dataclasses import dataclass

import ray

from cluster.control.scheduler import Scheduler
from cluster.control.scheduler_state import SchedulerSettings
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
    scheduler: object
    hosts: list  # SimHost actor handles
    workers: dict[str, tuple[int, str]]  # worker id -> (host index, role)

    @classmethod
    def start(cls, num_workers: int, per_host: int = 64, spec: SimSpec | None = None,
              settings: SchedulerSettings | None = None, timeout_s: float = 120.0) -> Fleet:
        """Half prefill, half decode workers (at least one of each), `per_host` to a process."""
        if num_workers < 2:
            raise ValueError("a fleet needs at least one prefill and one decode worker")
        spec = spec or SimSpec()
        scheduler = ray.remote(Scheduler).options(num_cpus=0).remote(settings or fleet_settings())
        names = [(f"sim-{'p' if i % 2 == 0 else 'd'}{i}", "prefill" if i % 2 == 0 else "decode")
                 for i in range(num_workers)]  # interleaved: every host has both roles
        groups = [names[i:i + per_host] for i in range(0, num_workers, per_host)]
        hosts = [ray.remote(SimHost).options(num_cpus=0).remote(group, spec, scheduler, MODEL_ID) for group in groups]
        ray.get([h.start.remote() for h in hosts], timeout=timeout_s)
        fleet = cls(scheduler, hosts, {wid: (i, role) for i, group in enumerate(groups) for wid, role in group})
        fleet.wait_registered(set(fleet.workers), timeout_s)
        return fleet

    def wait_registered(self, worker_ids: set[str], timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            known = set(ray.get(self.scheduler.state.remote(), timeout=timeout_s).workers)
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
        ray.get(self.scheduler.check_integrity.remote(), timeout=timeout_s)
        return hosts

    def shutdown(self) -> None:
        for actor in [*self.hosts, self.scheduler]:
            ray.kill(actor, no_restart=True)
