"""What a worker measures about itself: step costs, handoff outcomes, lease overruns, memory.

The scheduler's cost model and load shedding read the step costs; metrics export the counters.
Only the engine thread writes here.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field


@dataclass
class WorkerMeter:
    leases_expired: int = 0
    lease_overrun_s: float = 0.0  # the latest any lease was released after its deadline
    transfers_sent: int = 0
    transfers_failed: int = 0
    adopted: int = 0
    kv_bytes_sent: int = 0
    step_s: float | None = None  # smoothed; a new prompt first waits for the step in progress
    prefill_s_per_token: float | None = None  # smoothed, from prefill-dominated steps
    first_token_waits: list[tuple[str, float]] = field(default_factory=list)  # (request id, s) not yet reported

    def step(self, seconds: float, tokens: int) -> None:
        self.step_s = seconds if self.step_s is None else 0.8 * self.step_s + 0.2 * seconds
        if tokens >= 32:  # prefill-dominated steps give the per-token prefill cost
            cost = seconds / tokens
            prev = self.prefill_s_per_token
            self.prefill_s_per_token = cost if prev is None else 0.8 * prev + 0.2 * cost

    def lease_expired(self, late_s: float) -> None:
        self.leases_expired += 1
        self.lease_overrun_s = max(self.lease_overrun_s, late_s)

    def take_first_token_waits(self) -> list[tuple[str, float]]:
        waits, self.first_token_waits = self.first_token_waits, []
        return waits

    def stats(self) -> dict:
        return {
            "prefill_s_per_token": self.prefill_s_per_token, "step_s": self.step_s,
            "leases_expired": self.leases_expired, "lease_overrun_s": self.lease_overrun_s,
            "transfers_sent": self.transfers_sent, "transfers_failed": self.transfers_failed,
            "adopted": self.adopted, "kv_bytes_sent": self.kv_bytes_sent, "rss_bytes": _rss_bytes(),
        }


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
