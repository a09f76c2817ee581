"""What a worker measures about itself: step costs, handoff outcomes, memory (lease outcomes are the
handoff table's).

The scheduler's cost model and load shedding read the step costs; metrics export the counters.
Only the engine thread writes here.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from actors.protocol.messages import FirstTokenWait, TransferSample, WorkerStats
from actors.protocol.handoff_phase import HandoffPhase
from actors.worker.handoff_table import HandoffTable
from actors.worker.spec import WorkerSpec


@dataclass
class WorkerMeter:
    transfers_sent: int = 0
    transfers_failed: int = 0
    adopted: int = 0
    kv_bytes_sent: int = 0
    step_s: float | None = None  # smoothed; a new prompt first waits for the step in progress
    prefill_s_per_token: float | None = None  # smoothed, from prefill-dominated steps
    first_token_waits: list[FirstTokenWait] = field(default_factory=list)  # not yet reported
    transfers: list[TransferSample] = field(default_factory=list)  # not yet reported

    def step(self, seconds: float, tokens: int) -> None:
        self.step_s = seconds if self.step_s is None else 0.8 * self.step_s + 0.2 * seconds
        if tokens >= 32:  # prefill-dominated steps give the per-token prefill cost
            cost = seconds / tokens
            prev = self.prefill_s_per_token
            self.prefill_s_per_token = cost if prev is None else 0.8 * prev + 0.2 * cost

    def take_first_token_waits(self) -> tuple[FirstTokenWait, ...]:
        waits, self.first_token_waits = self.first_token_waits, []
        return tuple(waits)

    def landed(self, prefill_worker: str, nbytes: int, sent: float | None, landed: float) -> None:
        if sent is not None:
            self.transfers.append(TransferSample(prefill_worker, nbytes, max(landed - sent, 0.0)))

    def take_transfers(self) -> tuple[TransferSample, ...]:
        samples, self.transfers = self.transfers, []
        return tuple(samples)

    def stats(self, spec: WorkerSpec, load, table: HandoffTable, live_requests: int,
              inbox_prompts: dict[str | None, int], tokens_dropped: int, receiver,
              command_drops: dict[str, int]) -> WorkerStats:
        """What the worker reports: its engine's `load`, its handoff table's leases, and these counters
        (`inbox_prompts`: prompt tokens by tenant still in the worker's inbox)."""
        queued = dict(load.queued_prefill_by_tenant)
        for tenant, tokens in inbox_prompts.items():
            queued[tenant] = queued.get(tenant, 0) + tokens
        receiver_dropped = receiver.dropped() if receiver is not None else {}
        dropped = [("kv_receiver", reason, n) for reason, n in receiver_dropped.items()]
        dropped += [("command_port", reason, n) for reason, n in command_drops.items()]
        return WorkerStats(
            spec.worker_id, spec.role, load.free_blocks, load.num_blocks, load.used_blocks,
            load.running, load.waiting, sum(queued.values()), load.preemptions,
            reserved=table.count(HandoffPhase.RESERVED), held=table.count(HandoffPhase.HELD), writing=table.writing(),
            live_requests=live_requests, tokens_dropped=tokens_dropped,
            leases_expired=table.expired, lease_overrun_s=table.overrun_s,
            transfers_sent=self.transfers_sent, transfers_failed=self.transfers_failed,
            late_pages_dropped=table.late_pages_dropped, adopted=self.adopted, kv_bytes_sent=self.kv_bytes_sent,
            rss_bytes=rss_bytes(), step_s=self.step_s, prefill_s_per_token=self.prefill_s_per_token,
            dropped_messages=tuple(sorted(dropped)),
            queued_prefill_by_tenant=tuple((tenant, n) for tenant, n in queued.items() if n > 0),
        )


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
