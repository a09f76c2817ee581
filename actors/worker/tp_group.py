"""A tensor-parallel worker: rank 0 is the Worker actor (scheduler link, batcher, sampling, KV
bookkeeping); ranks 1..N-1 are `TPRank` actors it creates in the other bundles of its placement group
(STRICT_PACK: one node), each holding its shard of the weights and of the KV cache and running the
steps rank 0 leads (ModelRunner.follow). Each rank has its own KV ends (kv_handoff.py): a prefill rank
sends its heads of a handoff when rank 0 leads one, a decode rank receives its heads and asks rank 0's
piece desk before writing them (piece_desk.py).

The group lives and dies as one worker. The ranks are rank 0's children: when rank 0's process ends,
Ray ends them. When a rank ends, rank 0 sees its `run` call return (`lost`), fails its requests and
exits, so Ray restarts rank 0, which makes a fresh group: the scheduler sees one worker restart.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
from datetime import timedelta

import ray
import torch
import torch.distributed as dist
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from actors.engine.config import EngineConfig
from actors.engine.model.default_model import ensure_on_this_node
from actors.engine.model.parallel import DistComm, TPShard
from actors.engine.model.runner import ModelRunner
from actors.worker.kv_handoff import HandoffEnds
from actors.worker.spec import WorkerSpec
from kv_transfer.collective_transport import host_rendezvous, rendezvous_of

log = logging.getLogger("tandem.worker")
# How long joining the group and any collective may wait. It covers the ranks' start (importing torch took
# minutes beside a CPU hog); a rank that dies is noticed at once (its `run` call fails, its sockets close),
# so only a rank that hangs alive waits this long before the step fails and the group restarts.
COLLECTIVE_TIMEOUT_S = 300.0


def _backend(engine: EngineConfig) -> str:
    return "nccl" if engine.device.startswith("cuda") else "gloo"


class TPRank:
    """Rank r > 0 of a tensor-parallel worker."""

    def __init__(self, spec: WorkerSpec, rank: int, init_method: str):
        self.spec, self.rank, self.init_method = spec, rank, init_method
        self.ends: HandoffEnds | None = None

    def run(self) -> None:
        """Join the group, load this rank's shard, then run rank 0's steps until it says stop."""
        spec = self.spec
        torch.set_num_threads(spec.torch_threads)
        engine = dataclasses.replace(spec.engine, model=ensure_on_this_node(spec.engine.model, spec.engine.model_source))
        timeout = timedelta(seconds=COLLECTIVE_TIMEOUT_S)
        dist.init_process_group(_backend(engine), rank=self.rank, world_size=spec.tensor_parallel_size,
                                timeout=timeout, **rendezvous_of(self.init_method, timeout))
        comm = DistComm(TPShard(self.rank, spec.tensor_parallel_size))
        dist.barrier()  # every rank has built its groups: rank 0 closes the rendezvous after this
        runner = ModelRunner.from_config(engine, comm)
        # This rank's own KV ends: a prefill rank sends its heads, a decode rank receives its heads.
        self.ends = HandoffEnds(spec, runner.kv_caches, (runner.model.total_kv_heads, runner.model.kv_heads_by_rank),
                                runner.comm)
        self.ends.join()
        done = threading.Event()
        threading.Thread(target=self._watch_receiver, args=(done,), name="kv-receiver-watch", daemon=True).start()
        try:
            runner.follow(on_task=self.ends.run_task)
        finally:
            done.set()
            self.ends.close()

    def _watch_receiver(self, done: threading.Event) -> None:
        """A rank whose KV receiving thread died could never land its heads again, and every handoff to
        the group would wait out its lease: the rank ends instead, and the group restarts as one worker."""
        receiver = self.ends.receiver
        while receiver is not None and not done.wait(1.0):
            if not receiver.alive:
                log.error("tensor-parallel rank %d: its KV receiver died; ending the rank", self.rank)
                os._exit(70)

    def kill_kv_receiver(self) -> None:
        """Chaos hook (faults.py's kill_kv_receiver, on this rank): its receiving thread stops."""
        if self.ends is not None and self.ends.receiver is not None:
            self.ends.receiver.close()

    def kv_bytes(self) -> tuple[int, int]:
        """KV page bytes this rank has sent and received (answered while `run` runs: a threaded actor)."""
        return self.ends.bytes_moved() if self.ends is not None else (0, 0)


class TPGroup:
    """Rank 0's side: starts the other ranks, joins the group with them, and watches them."""

    def __init__(self, spec: WorkerSpec):
        size = spec.tensor_parallel_size
        if spec.placement_group is None:
            raise ValueError(f"worker {spec.worker_id}: tensor_parallel_size={size} needs a placement group")
        # The group's rendezvous: a store on loopback (STRICT_PACK puts every rank on this node), open
        # only until the group has formed. (torch's tcp:// scheme would have rank 0's store listen on every
        # interface, unauthenticated, for the worker's whole life.)
        rendezvous, init_method = host_rendezvous("127.0.0.1", COLLECTIVE_TIMEOUT_S)
        rank_cls = ray.remote(max_concurrency=2)(TPRank)  # `run` for life, and queries
        self.ranks = [
            rank_cls.options(
                num_cpus=spec.rank_num_cpus, num_gpus=spec.rank_num_gpus,
                scheduling_strategy=PlacementGroupSchedulingStrategy(spec.placement_group, placement_group_bundle_index=r),
            ).remote(spec, r, init_method)
            for r in range(1, size)
        ]
        self._runs = [rank.run.remote() for rank in self.ranks]
        timeout = timedelta(seconds=COLLECTIVE_TIMEOUT_S)
        dist.init_process_group(_backend(spec.engine), rank=0, world_size=size, timeout=timeout,
                                **rendezvous_of(init_method, timeout))
        self.comm = DistComm(TPShard(0, size))
        dist.barrier()  # every rank has joined and built its groups (NCCL's included): nobody needs the store
        del rendezvous  # its port closes
        self.lost: str | None = None  # why the group broke, once a rank has ended
        self._stopping = False
        threading.Thread(target=self._watch, name=f"tp-watch-{spec.worker_id}", daemon=True).start()

    def _watch(self) -> None:
        done, _ = ray.wait(self._runs, num_returns=1, timeout=None)
        if self._stopping:
            return
        try:
            ray.get(done[0])
            why = "returned"
        except ray.exceptions.RayError as exc:
            why = f"died: {type(exc).__name__}"
        self.lost = f"tensor-parallel rank {self._runs.index(done[0]) + 1} {why}"
        log.error("%s", self.lost)

    def between_steps(self, runner: ModelRunner) -> None:
        """Called by rank 0's engine thread every heartbeat: the other ranks wait for the next step in a
        collective, which must not reach its timeout while the worker is merely idle."""
        runner.keep_followers_waiting(every_s=COLLECTIVE_TIMEOUT_S / 10)

    def stop(self, runner: ModelRunner) -> None:
        """Rank 0 is done (its engine thread has ended): the other ranks leave their loops."""
        self._stopping = True
        runner.stop_followers()

