"""One request's record on the client side, its one place there: deltas back in order, text, stop
strings, results, when to migrate, its progress bound and deadline, where its deltas go and what its
pump did (stalls, moves, when each token went out).

Shared by the Python client and the HTTP ingress, both through the client's one pump (`TandemClient.pump`).
Deltas of one sample are put back in order by their offset (the first token comes from the prefill
worker, the rest from the decode worker); text and stop strings are computed here because workers only
produce token ids. A retryable failure (its worker was lost) sets `migration_pending`; the client's
`migrate` resubmits `migration_request()`, and every later delta of the given-up attempt is stale. So is
every later delta of an attempt the scheduler placed again itself (`TokenDelta.stale`).

The progress bound (`scheduler.progress_timeout_s`) holds in whatever phase the request is (admission,
a worker's queue, prefill, handoff, decode, a migration): the pump, having received nothing for the request
for half the bound, feeds it a `Stalled`, and the request moves like a worker loss (its old attempt is
aborted, so no work is done twice); still nothing at the full bound, it ends with a clean error. No
stream stays silent longer than the bound.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace

from actors.engine.text.detokenizer import IncrementalDetokenizer
from actors.protocol.ids import AttemptId
from actors.protocol.messages import Admitted, GenerateRequest, StageTimes, TokenDelta
from actors.protocol.request_status import RequestStatus
from actors.protocol.sampling_params import SamplingParams


# The most times one request is moved to another worker (its worker lost, its handoff expired, no progress
# for half the bound): each move is another attempt while the deadline allows, and the cap stops a request
# that kills every worker it lands on. The next failure after the last move ends the stream with an error.
MAX_MOVES = 16


@dataclass
class SampleResult:
    index: int
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    status: RequestStatus = RequestStatus.WAITING
    error: str | None = None
    num_cached_tokens: int = 0
    logprobs: list = field(default_factory=list)  # [token_id, logprob, [[id, logprob], ...]] per token
    prompt_logprobs: list | None = None  # the same per prompt token (None for the first), when asked for

    @property
    def finish_reason(self) -> str | None:
        return self.status.finish_reason()


@dataclass
class StreamEvent:
    index: int
    token_ids: list[int]
    text: str
    finished: bool
    finish_reason: str | None
    error: str | None = None
    logprobs: list | None = None


class _Sample:
    """One sample's stream: reorders deltas by offset, detokenizes, watches for stop strings."""

    def __init__(self, index: int, detokenizer: IncrementalDetokenizer | None):
        self.result = SampleResult(index)
        self._pending: dict[int, TokenDelta] = {}
        self._detok = detokenizer

    def feed(self, delta: TokenDelta) -> list[StreamEvent]:
        if not delta.token_ids and delta.status.is_finished():
            return [self._apply(delta)]  # a failure carries no tokens and ends the sample wherever it is
        self._pending[delta.offset] = delta
        events = []
        while not self.result.status.is_finished():
            d = self._pending.pop(len(self.result.token_ids), None)
            if d is None:
                break
            events.append(self._apply(d))
        return events

    def _apply(self, d: TokenDelta) -> StreamEvent:
        r = self.result
        r.token_ids.extend(d.token_ids)
        r.num_cached_tokens = d.num_cached_tokens
        if d.logprobs:
            r.logprobs.extend(d.logprobs)
        if d.prompt_logprobs is not None and r.prompt_logprobs is None:  # a migrated attempt's are the same
            r.prompt_logprobs = d.prompt_logprobs
        status = d.status
        text = ""
        if self._detok is not None and d.token_ids:
            out = self._detok.add_tokens(d.token_ids)
            text = out.new_text
            if out.stop_hit is not None:
                status = RequestStatus.FINISHED_STOPPED
        if status.is_finished() and self._detok is not None and self._detok.stop_hit is None:
            text += self._detok.flush()
        r.text += text
        r.status = status if status.is_finished() else RequestStatus.DECODING
        r.error = d.error
        return StreamEvent(r.index, d.token_ids, text, status.is_finished(), status.finish_reason(), d.error, d.logprobs)




@dataclass(frozen=True)
class MigrationRefused:
    """Put in a request's inbox when its migration was not admitted: the stream fails."""

    reason: str


@dataclass(frozen=True)
class SchedulerForgot:
    """Put in a request's inbox by the client's audit: a restarted scheduler (`epoch`) does not
    know the request and no live worker holds it. Like a worker loss: the stream migrates."""

    epoch: str


@dataclass(frozen=True)
class Stalled:
    """Fed by the pump at `RequestStream.next_stall_check(bound)` when nothing arrived since."""

    bound_s: float


@dataclass(frozen=True)
class PastDeadline:
    """Fed by the pump once the request's deadline has passed: it ends TIMED_OUT (and is aborted)."""


class RequestStream:
    """All samples of one request; `feed` every delta that arrives, in any order."""

    def __init__(self, request: GenerateRequest, tokenizer=None, max_migrations: int = MAX_MOVES,
                 started: float | None = None, deadline: float | None = None):
        """`started` (time.monotonic()): when the request was sent, its admission included; None: now.
        `deadline` (the same clock): when it ends TIMED_OUT wherever it is; None: never."""
        self.request = request
        self.started = time.monotonic() if started is None else started
        self.deadline = deadline
        self.own_deadline = False  # the deadline is the caller's own choice (an HTTP `timeout`), not the server's
        # The client's (client.py): where its deltas go (an `Inbox` for its pump, or any `put` of raw deltas),
        # the scheduler shard that admits it, the scheduler incarnation that admitted its attempt (None while
        # an admission is pending), and whether the client is done with it (`finish`).
        self.inbox = None
        self.shard = 0
        self.epoch: str | None = None
        self.closed = False
        # What its pump saw: stalls fed, moves to another worker, its deadline passing, and when each
        # sample's tokens went out (time.perf_counter(), one entry per token).
        self.stalls = 0
        self.moves = 0
        self.timed_out = False
        self.emitted: dict[int, list[float]] = {}
        # The scheduler's answer for each of its attempts, first to last: which workers prefill and decode it.
        self.routes: list[Admitted] = []
        params = request.params
        self.samples = [_Sample(i, _detokenizer(tokenizer, list(request.prompt_token_ids), params))
                        for i in range(params.n)]
        self.times = StageTimes()  # worker phase stamps, merged from every delta that carries them
        self.received_tokens = 0  # generated by the cluster and received, emitted or not (e.g. after a stop)
        self.migrations_left = max_migrations if params.n == 1 else 0
        self.migration_pending = False  # its worker was lost: resubmit with what was emitted so far
        self._dead_attempts: set[AttemptId] = set()  # given up on: their late deltas are stale
        self._attempts_seen: set[AttemptId] = set()
        self._ended_here = False  # ended by this side (deadline, refused migration): abort it in the cluster
        self._moved_after_stall = False
        # The last token that reached the client, or the request's start: the bound counts its admission too.
        self.last_progress = self.started

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def prompt_token_ids(self) -> tuple[int, ...]:
        return self.request.prompt_token_ids

    @property
    def params(self) -> SamplingParams:
        return self.request.params

    @property
    def finished(self) -> bool:
        return all(s.result.status.is_finished() for s in self.samples)

    @property
    def needs_abort(self) -> bool:
        """The cluster may still be generating: unfinished, or ended here (a stop string, the request's
        deadline, a refused migration) rather than by the cluster."""
        stopped_by_text = any(s._detok is not None and s._detok.stop_hit is not None for s in self.samples)
        return not self.finished or stopped_by_text or self._ended_here

    def migration_request(self) -> GenerateRequest:
        """The request to submit again after a worker loss: continue from the tokens already emitted."""
        self.migration_pending = False
        return self.request.continued(self.samples[0].result.token_ids)

    def fail(self, message: str, status: RequestStatus = RequestStatus.FAILED) -> list[StreamEvent]:
        """End every unfinished sample here (FAILED, or TIMED_OUT at the request's deadline)."""
        events = []
        self._ended_here = self._ended_here or not self.finished
        for s in self.samples:
            if not s.result.status.is_finished():
                events += s.feed(TokenDelta(_CLIENT_SIDE, s.result.index, 0, (), status, 0, 0, message))
        return events

    def _forgotten(self, forgot: SchedulerForgot) -> list[StreamEvent]:
        if self.finished:
            return []  # its last delta came in before the audit's answer
        if self.migrations_left <= 0:
            return self.fail(f"the scheduler restarted (now {forgot.epoch}) and no worker holds the request")
        self._move(self._attempts_seen)
        return []

    def wait_s(self, bound_s: float) -> float:
        """How long a pump may wait for the next delta before it feeds `silence(bound_s)`."""
        until = self.next_stall_check(bound_s)
        if self.deadline is not None:
            until = min(until, self.deadline)
        return max(until - time.monotonic(), 0.0)

    def silence(self, bound_s: float) -> Stalled | PastDeadline:
        """What a pump feeds when nothing came within `wait_s`."""
        if self.deadline is not None and time.monotonic() >= self.deadline:
            return PastDeadline()
        return Stalled(bound_s)

    def next_stall_check(self, bound_s: float) -> float:
        """When (monotonic) a pump that hears nothing more should feed a `Stalled`: at half the bound the
        request moves, at the full bound it ends (a moment before, so that the error reaches the client
        within the bound)."""
        return self.last_progress + (bound_s - DELIVERY_S if self._moved_after_stall else bound_s / 2)

    def _stalled(self, stall: Stalled) -> list[StreamEvent]:
        silent_s = time.monotonic() - self.last_progress
        if self.finished:
            return []
        self.stalls += 1
        if self._moved_after_stall or self.migrations_left <= 0 or silent_s >= stall.bound_s - DELIVERY_S:
            moved = ", also after it was moved" if self._moved_after_stall else ""
            return self.fail(f"the request made no progress for {silent_s:.0f}s (the progress bound is "
                             f"{stall.bound_s:.0f}s, scheduler.progress_timeout_s){moved}: the cluster is "
                             "overloaded or losing workers; retry later")
        self._moved_after_stall = True
        self._move(self._attempts_seen)
        return []

    def _move(self, given_up: set[AttemptId]) -> None:
        """Resubmit it (the client's `migrate`); whatever still arrives from `given_up` is stale."""
        self.migrations_left -= 1
        self.moves += 1
        self.migration_pending = True
        self._dead_attempts |= given_up

    def went_out(self, event: StreamEvent) -> None:
        """The pump handed `event` to its reader (per token: the time between tokens as the caller saw it)."""
        self.emitted.setdefault(event.index, []).extend([time.perf_counter()] * len(event.token_ids))

    @property
    def results(self) -> list[SampleResult]:
        return [s.result for s in self.samples]

    def feed(self, delta: TokenDelta | MigrationRefused | SchedulerForgot | Stalled | PastDeadline) -> list[StreamEvent]:
        if isinstance(delta, Stalled):
            return self._stalled(delta)
        if isinstance(delta, PastDeadline):
            self.timed_out = not self.finished
            return self.fail("the request ran past its deadline", RequestStatus.TIMED_OUT)
        if isinstance(delta, MigrationRefused):
            return self.fail(f"worker lost and the request could not be migrated: {delta.reason}")
        if isinstance(delta, SchedulerForgot):
            return self._forgotten(delta)
        if delta.attempt in self._dead_attempts:
            return []
        if delta.superseded:  # the scheduler placed the request again: the rest of this attempt is stale
            self._dead_attempts.add(delta.attempt)
            return []
        self._attempts_seen.add(delta.attempt)
        self.received_tokens += len(delta.token_ids)
        self.times = self.times.merged(delta.times)
        if delta.status == RequestStatus.FAILED and delta.retryable and self.migrations_left > 0:
            self._move({delta.attempt})
            return []  # no progress: the client saw nothing, so its silence goes on counting
        if delta.token_ids:
            self.last_progress = time.monotonic()
            self._moved_after_stall = False  # progress again: a later stall may move it again
        if delta.status == RequestStatus.FAILED and not delta.token_ids:
            events = []  # a request-wide failure ends every sample
            for s in self.samples:
                if not s.result.status.is_finished():
                    events += s.feed(replace(delta, index=s.result.index))
            return events
        return self.samples[delta.index].feed(delta)


_CLIENT_SIDE = AttemptId("", "")
# The final stall check comes this much before the bound: time for the error to reach the client (seen:
# errors decided at the bound arrived 50 ms past it under two CPU hogs).
DELIVERY_S = 0.5  # a failure decided here, not by any attempt


def _detokenizer(tokenizer, prompt_ids: list[int], params: SamplingParams) -> IncrementalDetokenizer | None:
    if tokenizer is None:
        return None
    return IncrementalDetokenizer(tokenizer, prompt_ids, params.stop, params.include_stop_str_in_output,
                                  params.skip_special_tokens)
