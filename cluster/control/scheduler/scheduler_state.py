"""What the scheduler keeps: its settings, one entry per registered worker, one per request in flight."""

from __future__ import annotations

import enum
import time
from dataclasses import asdict, dataclass, field, fields

from actors.protocol.ids import AttemptId
from actors.protocol.messages import GenerateRequest, WorkerInfo, WorkerStats
from actors.tracing.tracer import TracingSettings
from cluster.control.config import SchedulerSection
from cluster.control.scheduler.link_costs import LinkEstimate
from kv_transfer.curve import CurveKeys
from cluster.control.scheduler.routing import PrefillPlan, WorkerView


_DEFAULTS = SchedulerSection()  # the bounds' defaults live in the config, documented there


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
    heartbeat_timeout_s: float = _DEFAULTS.heartbeat_timeout_s
    progress_timeout_s: float = _DEFAULTS.progress_timeout_s
    local_prefill_max_tokens: int | None = _DEFAULTS.local_prefill_max_tokens  # None: any prompt
    local_prefill_overflow_s: float | None = _DEFAULTS.local_prefill_overflow_s  # None: no overflow
    tenant_turns: bool = False  # the workers' batchers take tenants in turn (engine.tenant_slowdown set)
    step_tokens: int | None = None  # the most prompt tokens one prefill step computes (engine.max_num_batched_tokens)
    max_predicted_ttft_s: float | None = None  # shed requests predicted to miss this (None: no shedding)
    curve_keys: CurveKeys | None = None  # the data plane's keys: clients that join later fetch them here
    host: str = "127.0.0.1"  # the address the clients' socket binds (`transfer.host`)
    tracing: TracingSettings | None = None  # where its placement spans go (`observability`); None: off


@dataclass
class WorkerEntry:
    handle: object
    info: WorkerInfo
    view: WorkerView
    last_seen: float = field(default_factory=time.monotonic)  # its last report or pulse: the process lives
    last_report: float = field(default_factory=time.monotonic)  # its engine thread's last report
    stats: WorkerStats | None = None  # the worker's latest report; None until its first
    # prompt tokens of placements on it still awaiting their decode reservation, by tenant
    held_by_tenant: dict[str | None, int] = field(default_factory=dict)


class Phase(enum.Enum):
    """Where a request's current attempt is, as the scheduler knows it."""

    SENT = "sent"  # sent to the worker that computes its prompt, which has not confirmed it yet
    RUNNING = "running"  # confirmed: queued, prefilling, or (prefilled on its decode worker) decoding
    AWAITING_PAGES = "awaiting_pages"  # rebuilt after a restart from a decode worker's reservation
    HANDED_OFF = "handed_off"  # the decode worker adopted its pages and decodes it


@dataclass
class Tracked:
    """One request in flight, as its current attempt. Written only by the RequestTable's transitions."""

    request: GenerateRequest  # as submitted: enough to re-route it or to tell its client it failed
    attempt: AttemptId  # what workers know it as
    workers: set[str]  # every worker that may hold state for the attempt
    decode_id: str  # the worker whose KV is committed to it until reclaim
    blocks: int  # KV blocks committed on the decode (or colocated) worker
    prefill: PrefillPlan | None = None  # None: prefilled on its decode worker (or not known, after a restart)
    phase: Phase = Phase.SENT
    since: float = field(default_factory=time.monotonic)  # when it entered its phase (monotonic)

    @property
    def request_id(self) -> str:
        return self.request.request_id


@dataclass(frozen=True)
class SchedulerCounters:
    """Counted per attempt: every submit (a move or a re-route is another) ends finished, failed (an attempt
    moved or placed again failed first) or cancelled, or is rejected."""

    submitted: int
    rejected: int
    finished: int
    failed: int
    cancelled: int
    local_prefills: int
    rerouted: int
    shed: int
    workers_lost: int
    lost_submits: int = 0  # attempts a live worker never confirmed: placed again


@dataclass(frozen=True)
class SchedulerState:
    """What the scheduler tells the ingress (readiness, metrics) and people: a snapshot, never a command."""

    workers: dict[str, WorkerView]
    worker_stats: dict[str, WorkerStats]
    incarnations: dict[str, str]
    draining: list[str]
    in_flight: int
    committed_blocks: dict[str, int]
    counters: SchedulerCounters
    tenant_blocks: dict[str, int] = field(default_factory=dict)  # KV committed per named tenant
    links: dict[str, LinkEstimate] = field(default_factory=dict)  # measured handoff cost, by "prefill->decode"
    port_drops: dict[str, int] = field(default_factory=dict)  # frames its clients' socket dropped, by reason

    def as_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def merged(cls, states: list[SchedulerState]) -> SchedulerState:
        """The scheduler shards' states as one (their workers are disjoint; counts add up)."""
        if len(states) == 1:
            return states[0]
        counters = SchedulerCounters(*(sum(getattr(s.counters, f.name) for s in states)
                                       for f in fields(SchedulerCounters)))
        tenants: dict[str, int] = {}
        drops: dict[str, int] = {}
        for s in states:
            for tenant, blocks in s.tenant_blocks.items():
                tenants[tenant] = tenants.get(tenant, 0) + blocks
            for reason, n in s.port_drops.items():
                drops[reason] = drops.get(reason, 0) + n
        return cls({w: v for s in states for w, v in s.workers.items()},
                   {w: v for s in states for w, v in s.worker_stats.items()},
                   {w: v for s in states for w, v in s.incarnations.items()},
                   sorted(w for s in states for w in s.draining), sum(s.in_flight for s in states),
                   {w: v for s in states for w, v in s.committed_blocks.items()}, counters, tenants,
                   {k: v for s in states for k, v in s.links.items()}, drops)
