"""What a worker is: its id, role, engine and how it reaches the others (lease, heartbeat, transport)."""

from __future__ import annotations

from dataclasses import dataclass

from actors.engine.config import EngineConfig
from actors.tracing.tracer import TracingSettings
from kv_transfer.curve import CurveKeys


@dataclass(frozen=True)
class WorkerSpec:
    worker_id: str
    # prefill: computes the prompt, samples the first token, pushes the KV pages to the reserved blocks of
    #   a decode worker, and holds its own blocks until the scheduler releases them (or the lease ends).
    # decode: reserves blocks for incoming KV, adopts the request when the pages have landed, decodes; it
    #   also runs whole requests (a local prefill) when the scheduler's cost model says so.
    # colocated: whole requests, prefill and decode in one engine.
    role: str
    engine: EngineConfig
    # The bounds come from the cluster's config (scheduler.lease_s, scheduler.heartbeat_s), where their
    # defaults live: no second default here.
    lease_s: float
    heartbeat_s: float
    torch_threads: int = 1
    # As a decode worker: the most prompt tokens one step computes (scheduler.local_prefill_max_tokens),
    # so a prompt of any length prefilled here (an overflow from a short prefill pool) slows the decodes
    # it shares steps with by one such chunk a step at most. None: the engine's token budget alone.
    decode_prefill_tokens: int | None = None
    zmq_transport: str = "ipc"
    host: str = "127.0.0.1"
    transfer_backend: str = "zmq"  # or "collective": torch.distributed over every worker of the cluster
    collective_init: str | None = None  # "tcp://host:port" rendezvous of the collective group
    rank: int | None = None
    world_size: int | None = None
    curve_keys: CurveKeys | None = None  # the cluster's data-plane keys (token streams; KV pages if kv_encrypted)
    kv_encrypted: bool = False
    kv_shm: bool = True  # KV pages through shared memory when both ends share a host (ipc)
    tracing: TracingSettings | None = None  # where its request spans go (`observability`); None: off
    # The Ray namespace of the cluster's per-node host KV tiers (kv_tier.host_bytes > 0); None: no tier.
    kv_tier_namespace: str | None = None
    # Tensor parallelism: this worker is rank 0 of a group of this many rank actors, placed in the bundles
    # of `placement_group` (rank r in bundle r), each of ranks 1.. asking for these resources.
    tensor_parallel_size: int = 1
    placement_group: object | None = None
    rank_num_cpus: float = 1.0
    rank_num_gpus: float = 0.0
