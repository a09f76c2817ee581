"""Start (or join) Ray, create the scheduler actor (or its shards) and the worker pools from config, tear
them down."""

from __future__ import annotations

import dataclasses
import itertools
import logging
import os
import stat
import tempfile
import time
from pathlib import Path
from typing import Callable

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy, PlacementGroupSchedulingStrategy

from actors.worker.remote import worker_actor
from actors.worker.spec import WorkerSpec
from cluster.control.config import TandemConfig
from cluster.control.lifecycle import ray_metric_ports
from cluster.control.lifecycle.kv_tiers import start_tiers, stop_tiers
from cluster.control.lifecycle.resize_state import ResizeState
from cluster.control.scheduler.actor import Scheduler, SchedulerSettings
from cluster.control.scheduler.scheduler_state import SchedulerState
from kv_transfer.collective_transport import host_rendezvous
from kv_transfer.curve import CurveKeys

log = logging.getLogger("tandem.launch")
NAMESPACE = "tandem"
SCHEDULER_NAME = "tandem-scheduler"
_MAX_SHARDS_LOOKED_UP = 64


def shard_name(index: int) -> str:
    """Shard 0 keeps the name a one-scheduler cluster has."""
    return SCHEDULER_NAME if index == 0 else f"{SCHEDULER_NAME}-{index}"


def find_schedulers() -> list:
    """The running cluster's scheduler shards, in order ([] when none runs in this Ray namespace)."""
    found = []
    for index in range(_MAX_SHARDS_LOOKED_UP):
        try:
            found.append(ray.get_actor(shard_name(index), namespace=NAMESPACE))
        except ValueError:
            break
    return found


class Cluster:
    def __init__(self, config: TandemConfig, scheduler, workers: dict, owns_ray: bool, model_dir: str,
                 keys: CurveKeys | None = None):
        """`scheduler`: the scheduler actor, or the list of its shards."""
        self.config = config
        self.keys = keys  # the data plane's CURVE keys (None: `transfer.encryption: none`)
        self.schedulers = list(scheduler) if isinstance(scheduler, (list, tuple)) else [scheduler]
        self.scheduler = self.schedulers[0]
        self._shard_of: dict[str, int] = {}  # worker id -> the shard it registers with
        self.workers = workers  # worker id -> actor handle
        # The last measured start of new workers (spawn to registered): what a cold start costs here, which a
        # role flip must beat (scaling.py). None until measured.
        self.worker_start_s: float | None = None
        self.groups: dict[str, PlacementGroup] = {}  # tensor-parallel worker id -> its ranks' placement group
        self.resizes = ResizeState()  # workers a resize still waits for (scaling.py)
        self._owns_ray = owns_ray
        self.model_dir = model_dir
        self.closers: list[Callable[[], None]] = []  # what shutdown() closes first (the clients opened on it)
        self._engine = config.engine_config(detokenize=False)  # workers stream ids; text is the client's
        self._indices = {role: itertools.count() for role in ("prefill", "decode", "colocated")}
        self.tiers: dict[str, object] = {}  # node id -> its host KV tier actor (kv_tier.host_bytes > 0)

    @classmethod
    def start(cls, config: TandemConfig, address: str | None = None, ready_timeout_s: float = 300.0) -> "Cluster":
        """`ready_timeout_s`: how long the workers may take, all told, to load and register (a loaded host
        can take minutes to import torch)."""
        ready_by = time.monotonic() + ready_timeout_s
        owns_ray = not ray.is_initialized()
        if owns_ray:
            os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
            # Ray runs its workers at nice 15 so its own daemons stay responsive; here the workers *are*
            # the job, and at nice 15 any busy neighbour starves them (a worker took over 300 s to
            # import torch beside one `stress-ng --cpu 2`). The raylet reads this when ray.init starts it.
            os.environ.setdefault("RAY_worker_niceness", "0")
            # Ray's own Prometheus exporter (the dashboard agent's) listens on every interface with no
            # authentication, dashboard or not: actor names, node memory and CPU, the session name. tandem
            # serves its own /metrics; set RAY_enable_metrics_collection=1 to have Ray's too.
            os.environ.setdefault("RAY_enable_metrics_collection", "0")
            _private_ray_token()  # ~/.ray made 0700 before Ray writes a new token into it
            needed = sum(p.replicas * p.num_cpus * p.tensor_parallel_size for p in config.pools().values()) + 1
            kwargs = {"namespace": NAMESPACE, "include_dashboard": False, "log_to_driver": True}
            if address:
                ray.init(address=address, **kwargs)
            else:
                # Logical CPUs with room to scale the pools up on this machine (`tandem scale`).
                # Its sessions under a directory of this user's alone (`private_ray_root`); Ray, its workers and a
                # later `--address auto` find them there through RAY_TMPDIR.
                os.environ["RAY_TMPDIR"] = private_ray_root()
                ray_metric_ports.hold()
                ray.init(num_cpus=max(4 * int(needed), os.cpu_count() or 1), **kwargs)
            _private_ray_token()  # Ray writes ~/.ray/auth_token 0644
        engine = config.engine_config(detokenize=False)  # workers stream ids; text is the client's
        keys = CurveKeys.generate() if config.transfer.tokens_encrypted() else None
        settings = SchedulerSettings(
            mode=config.mode, routing=config.scheduler.routing, block_size=engine.block_size,
            model_id=engine.model_id or Path(engine.model).name, reserve=config.scheduler.reserve,
            max_queued=config.scheduler.max_queued, queue_timeout_s=config.scheduler.queue_timeout_s,
            max_predicted_ttft_s=config.scheduler.max_predicted_ttft_s,
            local_prefill=config.scheduler.local_prefill, local_prefill_penalty=config.scheduler.local_prefill_penalty,
            local_prefill_max_tokens=config.scheduler.local_prefill_max_tokens,
            local_prefill_overflow_s=config.scheduler.local_prefill_overflow_s,
            tenant_turns=engine.tenant_slowdown is not None and engine.enable_chunked_prefill,
            step_tokens=engine.max_num_batched_tokens,
            prefill_s_per_token=config.scheduler.prefill_s_per_token,
            transfer_bytes_per_s=config.scheduler.transfer_bytes_per_s,
            heartbeat_timeout_s=config.scheduler.heartbeat_timeout_s,
            progress_timeout_s=config.scheduler.progress_timeout_s, curve_keys=keys, host=config.transfer.host,
            tracing=config.observability.tracing(),
        )
        _clear_orphaned_schedulers()
        schedulers = [ray.remote(Scheduler).options(
            name=shard_name(index), namespace=NAMESPACE, num_cpus=0,
            # Detached and restarted by Ray: a restarted scheduler starts empty and rebuilds its view as
            # the workers, finding their reports unanswered, register again with their live requests.
            lifetime="detached", max_restarts=-1,
            # Beside the ingress (the head), not on a worker host: cut off with one of those, it would
            # stall every admission. Hard: a soft affinity was seen placing it on a worker host (1 in 4
            # tries on an idle 4-node cluster); if this node dies, the ingress died with it.
            scheduling_strategy=NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False),
        ).remote(settings) for index in range(config.scheduler.shards)]
        workers = {}
        world_size = sum(p.replicas for p in config.pools().values())
        collective_init = rendezvous = None
        if config.transfer.backend == "collective":
            # Hosted here rather than by rank 0, which may land on any node: this node's address is known.
            rendezvous, collective_init = host_rendezvous(config.transfer.host)
        rank = itertools.count()
        cluster = cls(config, schedulers, workers, owns_ray, engine.model, keys)
        if config.kv_tier.host_bytes > 0:
            cluster.tiers = start_tiers(config.kv_tier.host_bytes, NAMESPACE)
        spawned = time.monotonic()
        for role, pool in config.pools().items():
            for _ in range(pool.replicas):
                cluster.spawn_worker(role, collective_init=collective_init, rank=next(rank), world_size=world_size)
        try:
            ray.get([w.info.remote() for w in workers.values()], timeout=ready_timeout_s)
            # Every worker has joined the collective group in its constructor: the unauthenticated
            # rendezvous store closes its port now rather than listening for the cluster's lifetime.
            del rendezvous
            cluster.wait_registered(set(workers), timeout_s=max(30.0, ready_by - time.monotonic()))
            cluster.worker_start_s = time.monotonic() - spawned
        except BaseException:
            cluster.shutdown()
            raise
        log.info("cluster ready: %s", ", ".join(sorted(workers)))
        return cluster

    def spawn_worker(self, role: str, collective_init: str | None = None, rank: int | None = None,
                     world_size: int | None = None) -> str:
        """Create one worker of a pool (it registers itself); returns its id. Ids are never reused, so a
        new worker cannot collide with the name of one still being torn down."""
        pool = self.config.pools()[role]
        worker_id = self.next_id(role)
        shard = self._shard_of[worker_id] = worker_index(worker_id) % len(self.schedulers)  # shards share each pool
        spec = WorkerSpec(
            worker_id=worker_id, role=role,
            engine=dataclasses.replace(self._engine, device="cuda" if pool.num_gpus > 0 else "cpu"),
            torch_threads=pool.torch_threads, lease_s=self.config.scheduler.lease_s,
            heartbeat_s=self.config.scheduler.heartbeat_s, zmq_transport=self.config.transfer.zmq_transport,
            host=self.config.transfer.host, transfer_backend=self.config.transfer.backend,
            collective_init=collective_init, rank=rank, world_size=world_size,
            curve_keys=self.keys, kv_encrypted=self.config.transfer.kv_encrypted(), kv_shm=self.config.transfer.shm,
            decode_prefill_tokens=self.config.scheduler.local_prefill_max_tokens or None,
            tracing=self.config.observability.tracing(),
            kv_tier_namespace=NAMESPACE if self.tiers else None,
        )
        placement = {}
        if pool.tensor_parallel_size > 1:
            group = self._rank_bundles(worker_id, pool)
            spec = dataclasses.replace(spec, tensor_parallel_size=pool.tensor_parallel_size, placement_group=group,
                                       rank_num_cpus=pool.num_cpus, rank_num_gpus=pool.num_gpus)
            placement = {"scheduling_strategy": PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=0)}
        self.workers[worker_id] = worker_actor().options(
            name=f"tandem-{worker_id}", namespace=NAMESPACE, num_cpus=pool.num_cpus,
            num_gpus=pool.num_gpus, resources=pool.resources or None, **placement,
            # One call at a time, in the order each caller sent them: an abort sent before a new
            # reservation for the same request id is applied first.
            max_concurrency=1,
            max_restarts=-1,  # a dead worker comes back and re-registers itself
        ).remote(spec, self.schedulers[shard])
        return worker_id

    def next_id(self, role: str) -> str:
        return f"{role}-{next(self._indices[role])}"

    def rename(self, old_id: str, new_id: str) -> None:
        """A flipped worker's process serves on under its new id (role_flip.py), with the same scheduler shard."""
        self.workers[new_id] = self.workers.pop(old_id)
        self._shard_of[new_id] = self._shard_of.pop(old_id, 0)

    def scheduler_of(self, worker_id: str):
        """The scheduler shard the worker registers with."""
        return self.schedulers[self._shard_of.get(worker_id, 0)]

    def _rank_bundles(self, worker_id: str, pool) -> PlacementGroup:
        """A tensor-parallel worker's placement group: one bundle per rank, all on one node (STRICT_PACK),
        reserved together before any rank is placed. It outlives rank 0's restarts; `stop_worker` removes it."""
        bundle = {"CPU": pool.num_cpus, "GPU": pool.num_gpus, **pool.resources}
        bundle = {k: v for k, v in bundle.items() if v > 0} or {"CPU": 0.001}
        group = placement_group([bundle] * pool.tensor_parallel_size, strategy="STRICT_PACK",
                                name=f"tandem-{worker_id}", lifetime=None)
        self.groups[worker_id] = group
        return group

    def stop_worker(self, worker_id: str) -> None:
        """Kill a worker (it is not restarted) and free what it held: a tensor-parallel worker's ranks go
        with rank 0 (they are its children), then its placement group."""
        handle = self.workers.pop(worker_id, None)
        if handle is not None:
            ray.kill(handle, no_restart=True)
        group = self.groups.pop(worker_id, None)
        if group is not None:
            remove_placement_group(group)

    def wait_registered(self, worker_ids: set[str], timeout_s: float) -> None:
        """Workers register themselves; wait until the scheduler knows every one of them."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                known = {wid for state in ray.get([s.state.remote() for s in self.schedulers], timeout=timeout_s)
                         for wid in state.workers}
            except ray.exceptions.RayActorError:  # a scheduler is restarting
                known = set()
            if worker_ids <= known:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"workers {sorted(worker_ids - known)} never registered with the scheduler")
            time.sleep(0.05)

    def check_integrity(self, timeout_s: float = 30.0) -> dict:
        """Every worker's, the scheduler's and the host KV tiers' invariants (raises on a violation); returns
        their stats as a plain report: {"workers": {id: stats}, "scheduler": state, "tiers": {node: stats}}."""
        self.resizes.check_integrity(self)
        stats = ray.get([w.check_integrity.remote() for w in list(self.workers.values())], timeout=timeout_s)
        shards = ray.get([s.check_integrity.remote() for s in self.schedulers], timeout=timeout_s)
        tiers = ray.get([t.check_integrity.remote() for t in self.tiers.values()], timeout=timeout_s)
        return {"workers": {s.worker_id: s.as_dict() for s in stats},
                "scheduler": SchedulerState.merged(shards).as_dict(),
                "tiers": {node: dataclasses.asdict(t) for node, t in zip(self.tiers, tiers)}}

    def shutdown(self) -> None:
        for close in self.closers:
            close()
        try:
            ray.get([w.shutdown.remote() for w in self.workers.values()], timeout=30)
        except Exception as exc:  # a worker that is already gone must not stop the teardown
            log.warning("worker shutdown: %s", exc)
        for worker_id in list(self.workers):
            self.stop_worker(worker_id)
        for scheduler in self.schedulers:
            ray.kill(scheduler, no_restart=True)
        stop_tiers(self.tiers)
        if self._owns_ray:
            ray.shutdown()
            ray_metric_ports.release()


def private_ray_root() -> str:
    """Where a Ray that tandem starts for itself keeps its sessions (logs, the raylet's and object store's
    sockets): `<this>/ray`, inside a directory of this user's alone. Ray's default, /tmp/ray, is writable by
    every user, and Ray makes its temp directory and each session in it so (for hosts several users share),
    again whenever a worker starts; the parent keeps them out of other users' reach. (Short, under /tmp:
    the sockets' paths must stay within the 107 bytes a Unix socket's path may have.)"""
    path = Path(tempfile.gettempdir()) / f"tandem-ray-{os.getuid()}"
    path.mkdir(mode=0o700, exist_ok=True)
    info = path.lstat()
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
        raise ValueError(f"{path} is not a directory of this user's: remove it, or start Ray yourself and use --address")
    path.chmod(0o700)
    return str(path)


def _private_ray_token() -> None:
    """Ray's default token file (~/.ray/auth_token, which `ray.init` writes 0644 in a 0755 directory when it
    makes a token) and its directory made this user's alone; a token of another path is the user's to keep.
    Anyone who reads the token can run code in the cluster."""
    directory = Path.home() / ".ray"
    directory.mkdir(mode=0o700, exist_ok=True)
    if directory.lstat().st_uid != os.getuid() or not directory.is_dir() or directory.is_symlink():
        raise ValueError(f"{directory} is not a directory of this user's: remove it, or set RAY_AUTH_TOKEN_PATH")
    directory.chmod(0o700)
    token = directory / "auth_token"
    try:
        info = token.lstat()
    except FileNotFoundError:
        return
    if stat.S_ISREG(info.st_mode) and info.st_uid == os.getuid():
        token.chmod(0o600)


def worker_index(worker_id: str) -> int:
    return int(worker_id.rsplit("-", 1)[1])


def role_of(worker_id: str) -> str:
    """A worker id is its role and an index never reused in that role (a flipped worker gets a new id)."""
    return worker_id.rsplit("-", 1)[0]


def _clear_orphaned_schedulers() -> None:
    """A detached scheduler outlives a `tandem serve` that crashed; with no workers left it is an
    orphan and goes. One that still has workers belongs to a running cluster: refuse to start."""
    for index, stale in enumerate(find_schedulers()):
        _clear_orphan(stale, shard_name(index))


def _clear_orphan(stale, name: str) -> None:
    try:
        workers = ray.get(stale.state.remote(), timeout=10).workers
    except Exception:  # dead or stuck: nothing to keep
        workers = {}
    if workers:
        raise ValueError(f"a tandem cluster already runs on this Ray cluster (workers {sorted(workers)}); "
                         "stop it first, or use --address to join another Ray cluster")
    ray.kill(stale, no_restart=True)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            ray.get_actor(name, namespace=NAMESPACE)
        except ValueError:
            return
        time.sleep(0.05)
