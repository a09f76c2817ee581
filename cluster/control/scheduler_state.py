"""What the scheduler keeps: its settings, one entry per registered worker, one per request in flight."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from cluster.control.routing import PrefillPlan, WorkerView


@dataclass
class SchedulerSettings:
    mode: str
    routing: str
    block_size: int
    model_id: str
    reserve: str
    max_queued: int
    queue_timeout_s: float
    local_prefill: bool
    local_prefill_penalty: float
    prefill_s_per_token: float
    transfer_bytes_per_s: float
    heartbeat_timeout_s: float = 10.0
    max_predicted_ttft_s: float | None = None  # shed requests predicted to miss this (None: no shedding)


@dataclass
class WorkerEntry:
    handle: object
    info: dict
    view: WorkerView
    last_seen: float = field(default_factory=time.monotonic)
    stats: dict = field(default_factory=dict)  # the worker's latest report, counters included


def attempt_of(wire_id: str) -> str:
    """The client's request id of a worker-facing id `<request id>@<attempt>`."""
    return wire_id.partition("@")[0]


@dataclass
class Tracked:
    request_id: str
    wire_id: str  # what workers know it as: one id per attempt, so a stale message cannot touch a newer one
    workers: set[str]  # every worker that may hold state for the request
    prefill: PrefillPlan | None = None
    decode_id: str | None = None
    blocks: int = 0  # KV blocks committed on the decode (or colocated) worker until reclaim
    handed_off: bool = False
    request: dict | None = None  # as submitted: enough to re-route it or to tell its client it failed
