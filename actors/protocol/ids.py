"""Request and attempt ids.

A client names a request once (`request_id`). The scheduler may place it more than once (a worker was
lost, the request migrated); each placement is one `AttemptId`, and workers know a request only by it.
A stale finish report, failure or token delta from an older attempt names another `AttemptId`, so it
can never touch the current one. Nothing is ever parsed out of a string.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class AttemptId:
    request_id: str
    attempt: str  # unique per scheduler incarnation and placement

    def __str__(self) -> str:  # logs only
        return f"{self.request_id}/{self.attempt}"
