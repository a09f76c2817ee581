"""Request status shared by every floor: one ordered enum, finished states after the live ones."""

from __future__ import annotations

import enum


class RequestStatus(enum.IntEnum):
    # Live states, in the order a request moves through them.
    WAITING = 0
    PREFILLING = 1
    TRANSFERRING = 2
    DECODING = 3
    PREEMPTED = 4
    # Everything above PREEMPTED is finished.
    FINISHED_STOPPED = 10
    FINISHED_LENGTH = 11
    CANCELLED = 12
    TIMED_OUT = 13
    FAILED = 14
    REJECTED = 15

    def is_finished(self) -> bool:
        return self > RequestStatus.PREEMPTED

    def finish_reason(self) -> str | None:
        """The OpenAI `finish_reason` for a finished status; None while live."""
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.CANCELLED: "abort",
    RequestStatus.TIMED_OUT: "error",  # the server gave up: an error, not something the client asked for
    RequestStatus.FAILED: "error",
    RequestStatus.REJECTED: "error",
}
