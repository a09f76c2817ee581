"""The frames to and from a scheduler shard's port over zmq (a DEALER at each peer, the scheduler's
ROUTER): the per-request traffic that once was a Ray call each. Clients submit and abort; worker
processes send their reports.

Every ask carries a number the client chose (`ask`), unique among its asks in flight; the answer names
it. A client whose scheduler restarted sends its unanswered asks again to the new one (a submit marked
`retried`, admitted at most once; an abort is idempotent).
"""

from __future__ import annotations

import msgspec

from actors.protocol.messages import Admitted, GenerateRequest, Rejected, WorkerReport


class Submit(msgspec.Struct, frozen=True):
    ask: int
    request: GenerateRequest


class SubmitBatch(msgspec.Struct, frozen=True, tag=True):
    """A client's submits of one event-loop tick."""

    submits: tuple[Submit, ...]


class AbortRequests(msgspec.Struct, frozen=True, tag=True):
    """Stop these requests wherever they run; answered by `AbortsTaken(ask)`."""

    ask: int
    request_ids: tuple[str, ...]


class Reports(msgspec.Struct, frozen=True, tag=True):
    """A worker process's heartbeat: the reports of every worker it hosts; answered by `ReportsTaken`."""

    ask: int
    reports: tuple[WorkerReport, ...]


class Answer(msgspec.Struct, frozen=True):
    """The scheduler's decision about one submit: exactly one of `admitted` and `rejected`."""

    ask: int
    admitted: Admitted | None = None
    rejected: Rejected | None = None

    @property
    def decision(self) -> Admitted | Rejected:
        return self.admitted if self.admitted is not None else self.rejected

    @classmethod
    def of(cls, ask: int, decision: Admitted | Rejected) -> Answer:
        if isinstance(decision, Admitted):
            return cls(ask, admitted=decision)
        return cls(ask, rejected=decision)


class Answers(msgspec.Struct, frozen=True, tag=True):
    """The decisions taken in one scheduler tick for one client (each submit is answered once)."""

    answers: tuple[Answer, ...]


class AbortsTaken(msgspec.Struct, frozen=True, tag=True):
    ask: int


class ReportsTaken(msgspec.Struct, frozen=True, tag=True):
    """`unknown`: the reporting workers this scheduler does not know (it restarted, or gave up on them):
    they register again."""

    ask: int
    unknown: tuple[str, ...] = ()


ToScheduler = SubmitBatch | AbortRequests | Reports
ToClient = Answers | AbortsTaken | ReportsTaken
