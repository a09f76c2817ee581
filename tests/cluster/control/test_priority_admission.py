"""Priority classes at admission (`GenerateRequest.priority`: the HTTP `service_tier` priority -1, default 0,
flex 1), on a real 1P+1D cluster whose decode worker's KV is all but taken by one long stream.

The decode worker has 1,005 blocks; the holder takes 1,001 (16 + 16,000 tokens, a minute of decoding: it is
cancelled, never waited out). A big request (16 + 8,032 tokens: 503 blocks) fits only once the holder is gone,
and two never fit at once: with the holder cancelled, big requests are admitted one at a time, each cancelled
once admitted to make room for the next. A small one (64 tokens: 4 blocks) fits beside the holder.
"""

from __future__ import annotations

import asyncio
import time

import pytest
import ray

from actors.protocol.sampling_params import SamplingParams
from cluster.control.lifecycle.launch import Cluster
from cluster.control.scheduler.room_waiters import RoomWaiters
from cluster.frontend.open_client import open_client
from tests.helpers.cluster import load, wait_until_idle
from tests.helpers.models import make_hf_model

FLEX, DEFAULT, PRIORITY = 1, 0, -1  # request_hints.py's classes for service_tier flex, default, priority
PROMPT = list(range(10, 26))  # 16 tokens
HOLDER = SamplingParams(temperature=0.0, max_tokens=16_000, ignore_eos=True)  # 1,001 of the 1,005 blocks
BIG = SamplingParams(temperature=0.0, max_tokens=8_032, ignore_eos=True)  # 503 blocks: two never fit at once
SMALL = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)  # 4 blocks: fits beside the holder
WAIT_S = 60.0


@pytest.fixture(scope="module")
def cluster(ray_session, tmp_path_factory):
    model = make_hf_model(tmp_path_factory.mktemp("long-context"), "llama", with_tokenizer=True, vocab_size=2048,
                          max_position_embeddings=16_384)
    config = load("local.yaml", num_kv_blocks=1005)
    cluster = Cluster.start(config.model_copy(update={"model": config.model.model_copy(update={"path": str(model)})}))
    yield cluster
    cluster.shutdown()


def _waiting(cluster: Cluster) -> int:
    """Requests in admission at the scheduler (waiting for room, or placing)."""
    (decode,) = [p for p in ray.get(cluster.scheduler.pool_load.remote(), timeout=30) if p.role == "decode"]
    return decode.waiting


async def _until_waiting(cluster: Cluster, n: int, why: str, admitted: list[str] = ()) -> None:
    deadline = time.monotonic() + WAIT_S
    while (now := await asyncio.to_thread(_waiting, cluster)) != n:
        assert time.monotonic() < deadline, f"{now} requests wait for admission, not {n}: {why} (admitted: {admitted})"
        await asyncio.sleep(0.02)


class Admissions:
    """Requests sent from one event loop; `order` is the order the scheduler admitted them in. `cancel_at_once`:
    each is cancelled as soon as it is admitted (its room goes to the next)."""

    def __init__(self, cluster: Cluster, cancel_at_once: bool):
        self.client, self.order, self.cancel_at_once, self.tasks = open_client(cluster), [], cancel_at_once, {}
        self.admitted = {}

    def send(self, name: str, params: SamplingParams, priority: int) -> None:
        self.tasks[name] = asyncio.create_task(self._one(name, params, priority))

    async def _one(self, name: str, params: SamplingParams, priority: int) -> None:
        submitted = await self.client.asubmit(self.client.request(PROMPT, params, priority=priority),
                                              timeout_s=WAIT_S)
        self.order.append(name)
        self.admitted[name] = submitted
        if self.cancel_at_once:
            self.client.finish(submitted.stream)

    async def admitted_now(self, name: str) -> None:
        await asyncio.wait_for(asyncio.shield(self.tasks[name]), WAIT_S)

    def cancel(self, name: str) -> None:
        self.client.finish(self.admitted[name].stream)

    async def all_admitted(self) -> None:
        await asyncio.wait_for(asyncio.gather(*self.tasks.values()), WAIT_S)

    def close(self) -> None:
        """Cancels what is still running (the cluster's shutdown closes the client)."""
        for submitted in self.admitted.values():
            self.client.finish(submitted.stream)


def test_waiting_requests_are_admitted_by_class_then_arrival(cluster):
    """Sent flex, flex, default, default, priority, priority (oldest first), they are admitted priority first."""
    async def scenario() -> list[str]:
        holder, waiters = Admissions(cluster, cancel_at_once=False), Admissions(cluster, cancel_at_once=True)
        try:
            holder.send("holder", HOLDER, DEFAULT)
            await holder.admitted_now("holder")
            sent = [("flex-1", FLEX), ("flex-2", FLEX), ("default-1", DEFAULT), ("default-2", DEFAULT),
                    ("priority-1", PRIORITY), ("priority-2", PRIORITY)]
            for i, (name, priority) in enumerate(sent):
                waiters.send(name, BIG, priority)
                await _until_waiting(cluster, i + 1, f"{name} should wait behind the holder")  # arrival order certain
            holder.cancel("holder")
            await waiters.all_admitted()
            return waiters.order
        finally:
            holder.close()
            waiters.close()

    order = asyncio.run(scenario())
    assert order == ["priority-1", "priority-2", "default-1", "default-2", "flex-1", "flex-2"]
    wait_until_idle(cluster)


def test_a_newcomer_waits_behind_a_more_urgent_class_and_a_priority_one_places_at_once(cluster):
    """A default request waits for room it cannot have yet; a flex newcomer that would fit in the room left
    waits behind it; a priority newcomer that fits takes that room at once."""
    async def scenario() -> list[str]:
        requests = Admissions(cluster, cancel_at_once=False)
        try:
            requests.send("holder", HOLDER, DEFAULT)
            await requests.admitted_now("holder")
            requests.send("default-big", BIG, DEFAULT)
            await _until_waiting(cluster, 1, "default-big should wait behind the holder")
            requests.send("flex-small", SMALL, FLEX)
            await _until_waiting(cluster, 2, "flex-small should wait behind default-big", requests.order)
            requests.send("priority-small", SMALL, PRIORITY)
            await requests.admitted_now("priority-small")
            assert requests.order == ["holder", "priority-small"], requests.order  # flex-small still waits
            requests.cancel("priority-small")  # its room frees: still not flex-small's, default-big waits
            requests.cancel("holder")
            await requests.all_admitted()
            return requests.order
        finally:
            requests.close()

    order = asyncio.run(scenario())
    assert order == ["holder", "priority-small", "default-big", "flex-small"]
    wait_until_idle(cluster)


def test_room_waiters_wake_by_class_then_arrival():
    async def scenario() -> tuple[list[str], bool, bool]:
        waiters, woken = RoomWaiters(), []

        async def wait(name: str, arrived: float, priority: int) -> None:
            await waiters.wait(arrived, WAIT_S, priority)
            woken.append(name)

        tasks = [asyncio.ensure_future(wait(name, arrived, priority))
                 for name, arrived, priority in [("flex-old", 1.0, FLEX), ("default", 2.0, DEFAULT),
                                                 ("priority", 3.0, PRIORITY), ("default-new", 4.0, DEFAULT)]]
        await asyncio.sleep(0)  # every waiter is in
        waiters.enter(DEFAULT)
        held = waiters.more_urgent_waiting(FLEX), waiters.more_urgent_waiting(DEFAULT)
        waiters.leave(DEFAULT)
        waiters.check_integrity()
        for _ in range(4):
            waiters.freed(1)
            for _ in range(5):  # (a woken waiter's task resumes a few loop turns later; the next poll is far)
                await asyncio.sleep(0)
        await asyncio.gather(*tasks)
        return woken, *held

    woken, flex_held, default_held = asyncio.run(scenario())
    # (the fallback poll may wake some first, by the same order)
    assert woken == ["priority", "default", "default-new", "flex-old"]
    assert flex_held and not default_held
