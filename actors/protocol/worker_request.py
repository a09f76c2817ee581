"""What a worker is told: its spec (role, engine, transfer) and the request dicts it receives.

A request arrives as a plain dict (Ray control calls, from the scheduler): `request_id` (one per attempt:
`<client id>@<attempt>`, so a stale message never touches a newer attempt),
`prompt_token_ids`, `params` (SamplingParams fields), `cache_salt`, `sink` (the client's zmq
endpoint), and optionally `dest` (prefill role: the decode worker's endpoint, block ids, lease id)
and `output_prefix` (tokens already generated, for a migrated request).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from actors.engine.config import EngineConfig
from actors.protocol.sampling_params import SamplingParams


@dataclass(frozen=True)
class WorkerSpec:
    worker_id: str
    role: str  # prefill | decode | colocated
    engine: EngineConfig
    torch_threads: int = 1
    lease_s: float = 30.0
    heartbeat_s: float = 0.05
    zmq_transport: str = "ipc"
    host: str = "127.0.0.1"
    transfer_backend: str = "zmq"  # or "collective": torch.distributed over every worker of the cluster
    collective_init: str | None = None  # "tcp://host:port" rendezvous of the collective group
    rank: int | None = None
    world_size: int | None = None


@dataclass
class WorkerRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    cache_salt: str | None
    sink: str
    dest: dict | None = None  # prefill role: {"endpoint", "block_ids"} of the decode worker
    output_prefix: list[int] = field(default_factory=list)  # tokens already generated (a migration)
    deadline: float | None = None  # lease end while reserved (decode) or held (prefill)
    timings: dict = field(default_factory=dict)  # wall-clock phase stamps sent with the stream


def request_from_wire(request: dict) -> WorkerRequest:
    return WorkerRequest(
        request_id=request["request_id"],
        prompt_token_ids=list(request["prompt_token_ids"]),
        params=SamplingParams(**request["params"]),
        cache_salt=request.get("cache_salt"),
        sink=request["sink"],
        dest=request.get("dest"),
        output_prefix=list(request.get("output_prefix") or []),
    )


def request_to_wire(req: WorkerRequest) -> dict:
    return {"request_id": req.request_id, "prompt_token_ids": req.prompt_token_ids, "params": dict(vars(req.params)),
            "cache_salt": req.cache_salt, "sink": req.sink, "dest": req.dest, "output_prefix": req.output_prefix}


def request_stub(request: dict) -> WorkerRequest:
    """Enough of a request that could not be parsed to report its failure to its sink."""
    return WorkerRequest(request["request_id"], list(request.get("prompt_token_ids", [])), SamplingParams(), None,
                    request["sink"])
