"""Load shedding on the predicted time to first token, through the scheduler's own placement code.

With no `max_predicted_ttft_s` configured the scheduler still refuses a request predicted to wait past
half the progress bound (it would be moved for silence anyway, losing its place); below that it admits.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time

import pytest
from actors.protocol.messages import GenerateRequest, KvRankEndpoint, Rejected, WorkerInfo, WorkerStats
from actors.protocol.sampling_params import SamplingParams
from cluster.control.scheduler.link_costs import LinkCosts
from cluster.control.scheduler.placement import Placement, Placer
from cluster.control.scheduler.prefix_index import PrefixIndex
from cluster.control.scheduler.registry import WorkerRegistry
from cluster.control.scheduler.request_table import RequestTable
from cluster.control.scheduler.scheduler_state import SchedulerSettings
from cluster.control.scheduler.ttft_guard import shed_guard

SETTINGS = SchedulerSettings(
    mode="disaggregated", routing="cache_aware", block_size=16, model_id="m", reserve="prompt_plus_max_tokens",
    max_queued=64, queue_timeout_s=30.0, local_prefill=False, local_prefill_penalty=1.0, prefill_s_per_token=1e-3,
    transfer_bytes_per_s=1e9)  # progress_timeout_s: the shipped 60 s
COST_S = 1e-3  # the prefill worker's measured seconds per prompt token


class _Handle:
    """The registry watches a worker's process through its handle; these workers never die."""

    def __getattr__(self, name):
        return self

    def remote(self, *args):
        return asyncio.get_running_loop().create_future()


def _stats(wid: str, role: str, queued_tokens: int) -> WorkerStats:
    return WorkerStats(wid, role, free_blocks=4096, num_blocks=4096, used_blocks=0, running=1, waiting=0,
                       queued_prefill_tokens=queued_tokens, preemptions=0, reserved=0, held=0, writing=0,
                       live_requests=1, tokens_dropped=0, leases_expired=0, lease_overrun_s=0.0, transfers_sent=0,
                       transfers_failed=0, late_pages_dropped=0, adopted=0, kv_bytes_sent=0, rss_bytes=0,
                       step_s=0.1, prefill_s_per_token=COST_S)


def _cluster(settings: SchedulerSettings, queued_tokens: int) -> tuple[WorkerRegistry, Placer]:
    """A 1P+1D cluster as the scheduler sees it (call inside a running event loop)."""
    registry = WorkerRegistry(settings.heartbeat_timeout_s, settings.progress_timeout_s, lambda wid, why: None)
    table = RequestTable()
    placer = Placer(settings, registry, table, PrefixIndex(), shed_guard(settings), LinkCosts(1e9))
    registry.on_change = table.on_change = placer.refresh
    for wid, role in (("prefill-0", "prefill"), ("decode-0", "decode")):
        endpoints = (KvRankEndpoint("tcp://127.0.0.1:1", 0, 1, 1),) if role == "decode" else ()
        registry.add(WorkerInfo(wid, role, endpoints, 4096, 16, 1024, "inc"), _Handle())
        registry.observe(_stats(wid, role, queued_tokens if role == "prefill" else 0))
    return registry, placer


def _request() -> GenerateRequest:
    return GenerateRequest("r", tuple(range(512)), SamplingParams(max_tokens=16), "ipc:///nowhere")


async def _place(settings: SchedulerSettings, queued_tokens: int) -> Placement | Rejected | None:
    _, placer = _cluster(settings, queued_tokens)
    return placer.place(_request(), [], 40, time.monotonic())


def test_without_a_target_a_request_that_would_be_moved_for_silence_is_refused():
    # 40,000 tokens queued at 1 ms each: ~40 s to its first token, past the move at 30 s of silence.
    refused = asyncio.run(_place(SETTINGS, 40_000))
    assert isinstance(refused, Rejected), refused
    assert "progress_timeout_s" in refused.reason and refused.retry_after_s >= 1, refused
    # 20,000 tokens: ~20 s, inside the bound: admitted to the same worker.
    admitted = asyncio.run(_place(SETTINGS, 20_000))
    assert isinstance(admitted, Placement) and admitted.prefill.worker_id == "prefill-0", admitted


def test_a_configured_target_is_the_limit():
    tight = dataclasses.replace(SETTINGS, max_predicted_ttft_s=5.0)
    refused = asyncio.run(_place(tight, 20_000))
    assert isinstance(refused, Rejected) and "max_predicted_ttft_s" in refused.reason, refused
    assert isinstance(asyncio.run(_place(tight, 2_000)), Placement)


def test_placements_awaiting_their_reservation_count_as_queued_whatever_the_worker_reports():
    """A burst: each admission awaits the decode worker's reservation before its prompt is sent, and the
    placements decided meanwhile must see the prompts already placed, or they all land on one queue."""
    async def scenario():
        registry, placer = _cluster(SETTINGS, 0)
        with registry.queued_meanwhile("prefill-0", 40_000, None):  # ~40 s of prompts placed, reservations pending
            assert isinstance(placer.place(_request(), [], 40, time.monotonic()), Rejected)
            registry.observe(_stats("prefill-0", "prefill", 0))  # its report cannot know of them yet
            assert isinstance(placer.place(_request(), [], 40, time.monotonic()), Rejected)
        # The reservations failed: nothing was sent.
        assert isinstance(placer.place(_request(), [], 40, time.monotonic()), Placement)
        registry.check_integrity()

    asyncio.run(scenario())


def test_the_best_ttft_is_the_guards_prediction_on_the_best_worker():
    async def scenario():
        _, placer = _cluster(SETTINGS, 20_000)  # no local prefill: the prefill worker's queue + the prompt
        # (20,000 + 512) tokens at 1 ms, plus the step in progress (0.1 s).
        assert placer.best_ttft_s(512) == pytest.approx(20.612), placer.best_ttft_s(512)
        _, local = _cluster(dataclasses.replace(SETTINGS, local_prefill=True), 20_000)
        assert local.best_ttft_s(512) == pytest.approx(0.612)  # its idle decode worker prefills it itself

    asyncio.run(scenario())
