"""What a worker measures about itself: step costs, handoff outcomes, memory (lease outcomes are the
handoff table's).

The scheduler's cost model and load shedding read the step costs; metrics export the counters.
Only the engine thread writes here.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from actors.protocol.messages import FirstTokenWait


@dataclass
class WorkerMeter:
    transfers_sent: int = 0
    transfers_failed: int = 0
    adopted: int = 0
    kv_bytes_sent: int = 0
    step_s: float | None = None  # smoothed; a new prompt first waits for the step in progress
    prefill_s_per_token: float | None = None  # smoothed, from prefill-dominated steps
    first_token_waits: list[FirstTokenWait] = field(default_factory=list)  # not yet reported

    def step(self, seconds: float, tokens: int) -> None:
        self.step_s = seconds if self.step_s is None else 0.8 * self.step_s + 0.2 * seconds
        if tokens >= 32:  # prefill-dominated steps give the per-token prefill cost
            cost = seconds / tokens
            prev = self.prefill_s_per_token
            self.prefill_s_per_token = cost if prev is None else 0.8 * prev + 0.2 * cost

    def take_first_token_waits(self) -> tuple[FirstTokenWait, ...]:
        waits, self.first_token_waits = self.first_token_waits, []
        return tuple(waits)


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
