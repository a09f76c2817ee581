"""Every message that crosses a process, typed. Who sends what:

client -> scheduler   over zmq (scheduler_wire.py): a tick's `GenerateRequest`s in one `SubmitBatch`, answered
                      `Admitted` | `Rejected` as decided; `AbortRequests`. Through Ray: `SchedulerPort`
                      (where that socket is), the audit of a restarted scheduler (`AdmittedBy` -> `Forgotten`)
worker -> scheduler   through Ray: `WorkerInfo` + `LiveRequest`s (register), `WorkerPulse` (while a long
                      step keeps the reports away); over zmq (scheduler_wire.py): `WorkerReport`s (every
                      heartbeat, and at once when an attempt finished or was handed off: `HandedOff`), one
                      `Reports` frame with every report of the workers a process hosts
scheduler -> worker   `WorkerRequest`s to submit or to reserve for (-> `KvReservation`), release/abort
                      (`AttemptId`), batched per tick and worker process: worker_commands.py
prefill -> decode     `HandoffNote` inside the KV transfer header (kv_transfer carries it as bytes)
any hop of a request  its `TraceContext` (W3C), when tracing is on (actors/tracing/spans.py)
inside a tensor-parallel worker: see tp_messages.py
worker -> client      `TokenDelta` batches over zmq (`actors.protocol.codec`)

Ray pickles the messages of its calls; the zmq messages go through the one codec. Defaults live here and in
`SamplingParams`, nowhere else.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace

from actors.protocol.handoff_phase import HandoffPhase
from actors.protocol.ids import AttemptId
from actors.protocol.kv_events import KVEvent
from actors.protocol.request_status import RequestStatus
from actors.protocol.sampling_params import SamplingParams

# ---- requests ----


@dataclass(frozen=True)
class TraceContext:
    """The W3C trace context of the span a message's receiver continues (its `traceparent` and `tracestate`
    headers, as text); messages carry None while tracing is off."""

    traceparent: str
    tracestate: str = ""


@dataclass(frozen=True)
class GenerateRequest:
    """A client's request as the scheduler admits it."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams
    sink: str  # the client's zmq PULL endpoint: where token deltas go
    cache_salt: str | None = None  # the tenant: salts the prefix-cache hashes
    kv_share: float | None = None  # most of its pool's KV the tenant (cache_salt) may hold at once; None: all
    deadline: float | None = None  # wall-clock time (time.time()) its client gives up: a moved request waits till then
    output_prefix: tuple[int, ...] = ()  # tokens the client already has: a migrated request continues after them
    retried: bool = False  # sent again: the scheduler died while admitting it (it must still run only once)
    moved: bool = False  # its client moved it (a lost worker, a stall): it supersedes the attempt in flight
    priority: int = 0  # admission order among waiting requests, lower first (service_tier priority -1, flex 1)
    affinity: str | None = None  # prompt_cache_key: requests of the tenant with the same one prefer one worker
    trace: TraceContext | None = None  # the span its next hop continues: the ingress's, then the scheduler's

    def __post_init__(self) -> None:
        object.__setattr__(self, "prompt_token_ids", tuple(self.prompt_token_ids))
        object.__setattr__(self, "output_prefix", tuple(self.output_prefix))

    def continued(self, output_prefix) -> GenerateRequest:
        """The same request, moved: to be continued after `output_prefix` (possibly none yet)."""
        return replace(self, output_prefix=tuple(output_prefix), retried=False, moved=True)


@dataclass(frozen=True)
class KvReservation:
    """Blocks a decode worker set aside for one attempt's pages, under a lease."""

    lease_id: str  # names the transfer on the wire; the decode worker maps it back to the attempt
    block_ids: tuple[int, ...]


@dataclass(frozen=True)
class KvRankEndpoint:
    """One rank of a decode worker: where its pages are pushed, and which of the model's KV heads its
    cache holds (all of them, unless the worker is tensor-parallel)."""

    endpoint: str
    first_head: int
    num_heads: int
    total_heads: int


@dataclass(frozen=True)
class KvDestination:
    """Where a prefill worker pushes an attempt's pages: to every rank of the decode worker, its heads."""

    decode_worker: str
    endpoints: tuple[KvRankEndpoint, ...]
    reservation: KvReservation


@dataclass(frozen=True)
class WorkerRequest:
    """One attempt of a request, as a worker receives it."""

    attempt: AttemptId
    request: GenerateRequest
    dest: KvDestination | None = None  # prefill role: push the KV here after the first token


@dataclass(frozen=True)
class Admitted:
    prefill: str
    decode: str
    cached_tokens: int = 0
    local: bool = False  # prefilled on its decode (or colocated) worker
    epoch: str = ""  # the scheduler incarnation that admitted it


@dataclass(frozen=True)
class AdmittedBy:
    """A request in flight at a client, and the scheduler incarnation that admitted its attempt."""

    request_id: str
    epoch: str


@dataclass(frozen=True)
class Forgotten:
    """The scheduler's answer to a client's audit: its incarnation, whether it has heard from every live
    worker since it started (`settled`), and of the requests asked about (admitted by an earlier
    incarnation) the ones it tracks again (`known`, learned from their workers) and the ones no live
    worker holds (`lost`: they ended, or died with a worker while no scheduler ran)."""

    epoch: str
    settled: bool
    known: tuple[str, ...] = ()
    lost: tuple[str, ...] = ()


@dataclass(frozen=True)
class SchedulerPort:
    """Where a scheduler incarnation takes its clients' submits and aborts and its workers' reports over
    zmq (scheduler_wire.py)."""

    endpoint: str
    epoch: str


@dataclass(frozen=True)
class Rejected:
    reason: str
    retry_after_s: float | None  # None: the request can never be admitted as it is (a client error)
    unavailable: bool = False  # no worker of the needed pool is registered at all


# ---- workers ----


@dataclass(frozen=True)
class WorkerInfo:
    worker_id: str
    role: str  # prefill | decode | colocated
    kv_endpoints: tuple[KvRankEndpoint, ...]  # decode workers: where pages are pushed (one per rank); else ()
    num_blocks: int
    block_size: int
    kv_bytes_per_token: int
    incarnation: str  # one per process: tells a restarted worker from one re-announcing itself
    command_endpoint: str = ""  # its process's command port: where the scheduler's commands go (zmq)


@dataclass(frozen=True)
class WorkerStats:
    worker_id: str
    role: str
    free_blocks: int
    num_blocks: int
    used_blocks: int
    running: int
    waiting: int
    queued_prefill_tokens: int  # engine queue plus prompts still in the worker's inbox
    preemptions: int
    reserved: int  # decode: reservations waiting for pages
    held: int  # prefill: pages sent, blocks held until released
    writing: int  # decode: transfers whose pages are being written now
    live_requests: int
    tokens_dropped: int
    leases_expired: int
    lease_overrun_s: float
    transfers_sent: int
    transfers_failed: int
    late_pages_dropped: int  # page writes refused because their reservation was already released
    adopted: int
    kv_bytes_sent: int
    rss_bytes: int
    step_s: float | None = None  # smoothed engine step time; None until measured
    prefill_s_per_token: float | None = None
    # (socket, reason, count) of messages its receiving loops threw away: "kv_receiver", "command_port"
    dropped_messages: tuple[tuple[str, str, int], ...] = ()
    # queued_prefill_tokens by tenant (the requests' cache salt): a tenant-fair batcher serves each in turn
    queued_prefill_by_tenant: tuple[tuple[str | None, int], ...] = ()

    def as_dict(self) -> dict:
        """For people and metrics (introspection), never for control decisions."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass(frozen=True)
class FinishedAttempt:
    attempt: AttemptId
    status: RequestStatus


@dataclass(frozen=True)
class FirstTokenWait:
    """Measured seconds from a worker receiving an attempt to its first token (checks TTFT predictions)."""

    attempt: AttemptId
    seconds: float


@dataclass(frozen=True)
class TransferSample:
    """One KV handoff as its decode worker saw it: `seconds` from the prefill worker starting the send to
    the last page written here (wall clocks of two hosts: as good as their synchronisation)."""

    prefill_worker: str
    nbytes: int
    seconds: float


@dataclass(frozen=True)
class HandedOff:
    """A decode worker adopted an attempt's pages: its prefill worker may free its copy."""

    attempt: AttemptId
    prefill_worker: str


@dataclass(frozen=True)
class WorkerReport:
    worker_id: str
    stats: WorkerStats
    finished: tuple[FinishedAttempt, ...] = ()
    kv_events: tuple[KVEvent, ...] = ()  # in order
    first_token_waits: tuple[FirstTokenWait, ...] = ()
    received: tuple[AttemptId, ...] = ()  # attempts submitted to this worker since its last report
    transfers: tuple[TransferSample, ...] = ()  # decode: handoffs that landed since the last report
    handed_off: tuple[HandedOff, ...] = ()  # decode: adopted since the last report


@dataclass(frozen=True)
class WorkerPulse:
    """The worker's process lives, though its engine thread (inside a long step, or a long command) has
    reported nothing for a while. Sent by a thread of its own (pulse.py)."""

    worker_id: str
    incarnation: str


@dataclass(frozen=True)
class LiveRequest:
    """A request a worker still holds state for, announced when it registers (again)."""

    phase: HandoffPhase
    request: WorkerRequest


# ---- data plane ----


@dataclass(frozen=True)
class StageTimes:
    """Wall-clock stamps of one attempt's phases on its workers; None: not reached (or not this worker's)."""

    received: float | None = None
    scheduled: float | None = None
    first_token: float | None = None
    sent: float | None = None  # prefill: the KV send began
    landed: float | None = None  # decode: the last page was written (the receiving thread's clock)
    adopted: float | None = None
    finished: float | None = None

    def merged(self, other: StageTimes | None) -> StageTimes:
        """These stamps overwritten by every stamp `other` has."""
        if other is None:
            return self
        return replace(self, **{f.name: v for f in fields(other) if (v := getattr(other, f.name)) is not None})


@dataclass(frozen=True)
class HandoffNote:
    """What the decode worker needs besides the pages to continue an attempt."""

    first_token: int
    num_cached_tokens: int
    prefill_worker: str
    times: StageTimes = field(default_factory=StageTimes)
    trace: TraceContext | None = None  # the prefill worker's KV send span: the adopt span continues it


@dataclass(frozen=True)
class TokenDelta:
    """New tokens of one sample of one attempt. `offset` counts the sample's output tokens before this
    delta, so a client puts deltas from two workers (first token from prefill, the rest from decode) in order."""

    attempt: AttemptId
    index: int
    offset: int
    token_ids: tuple[int, ...]
    status: RequestStatus
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    error: str | None = None
    logprobs: list | None = None  # [[token_id, logprob, [[id, logprob], ...]], ...] when asked for
    times: StageTimes | None = None  # on the first and the last delta of an attempt only
    retryable: bool = False  # a FAILED delta the client may retry elsewhere (its worker was lost)
    prompt_logprobs: list | None = None  # the first delta: one entry per prompt token (None for the first)
    superseded: bool = False  # the scheduler's word that `attempt` was placed again: see `stale`

    @classmethod
    def failure(cls, request: WorkerRequest, message: str, retryable: bool) -> TokenDelta:
        """The attempt ended with an error, wherever it was: every sample of it, no tokens."""
        return cls(request.attempt, 0, 0, (), RequestStatus.FAILED, len(request.request.prompt_token_ids), 0, message,
                   retryable=retryable)

    @classmethod
    def stale(cls, attempt: AttemptId) -> TokenDelta:
        """From the scheduler: the attempt's request was placed again without its client (its prefill worker
        was declared lost, or never confirmed it), so whatever still comes from this attempt (a worker that
        was only stalled wakes and finishes its step) is stale. No tokens and a live status: a reader of raw
        deltas sees nothing end."""
        return cls(attempt, 0, 0, (), RequestStatus.WAITING, superseded=True)
