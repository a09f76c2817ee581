"""The admission door and the room waiters, without Ray: refusal once the measured wait passes the
budget, never on an idle cluster's first burst, and one fallback poll however many wait."""

from __future__ import annotations

import asyncio
import time

from cluster.control.scheduler.admission_door import _FLOOR, AdmissionDoor
from cluster.control.scheduler.room_waiters import _WAKE_PER_POLL, RoomWaiters


class FakeClock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _busy_at_100_per_s(door: AdmissionDoor, clock: FakeClock) -> None:
    """Busy for 2 s admitting 100 per second with 50 waiting all along: the rate is about 100/s."""
    for _ in range(50):
        door.entered()
    for _ in range(200):
        clock.now += 0.01
        door.left(admitted=True)
        door.entered()

def test_a_burst_on_an_idle_cluster_is_never_refused():
    clock = FakeClock()
    door = AdmissionDoor(clock)
    for _ in range(10 * _FLOOR):
        assert door.refuse(budget_s=0.001) is None  # no rate measured yet
        door.entered()
    door.check_integrity()


def test_refused_once_the_queue_would_wait_past_the_budget():
    clock = FakeClock()
    door = AdmissionDoor(clock)
    _busy_at_100_per_s(door, clock)
    rate = door.rate()
    assert 90 < rate < 110, rate
    assert door.refuse(budget_s=1.0) is None  # 50 waiting at ~100/s: half a second
    assert door.refuse(budget_s=1.0, first_token_s=lambda: 0.3) is None
    # ... unless the prefill queue an admitted request then meets takes the rest of the budget.
    assert door.refuse(budget_s=1.0, first_token_s=lambda: 0.6) is not None and door.refused == 1
    door.refused = 0
    for _ in range(100):
        door.entered()
    refused = door.refuse(budget_s=1.0)  # 150 waiting: ~1.5 s
    assert refused is not None and refused.retry_after_s >= 1.0 and "overloaded" in refused.reason
    assert door.refused == 1
    for _ in range(150):
        door.left(admitted=False)
    assert door.waiting == 0 and door.refuse(budget_s=1.0) is None
    door.check_integrity()


def test_the_rate_forgets_an_old_slow_period():
    clock = FakeClock()
    door = AdmissionDoor(clock)
    for _ in range(40):
        door.entered()
    for _ in range(20):  # 10 per second for 2 s
        clock.now += 0.1
        door.left(admitted=True)
        door.entered()
    slow = door.rate()
    for _ in range(2000):  # then 1,000 per second for 2 s
        clock.now += 0.001
        door.left(admitted=True)
        door.entered()
    assert slow < 20 and door.rate() > 20 * slow


def test_one_fallback_poll_wakes_the_oldest_few():
    async def scenario():
        waiters = RoomWaiters()
        woken: list[int] = []

        async def wait(i: int) -> None:
            await waiters.wait(float(i), timeout_s=60.0)
            woken.append(i)

        tasks = [asyncio.ensure_future(wait(i)) for i in range(100)]
        deadline = time.monotonic() + 10
        while not woken:  # until the first poll's waiters run (they all resume on the same loop turn)
            assert time.monotonic() < deadline, "no fallback poll woke anyone"
            await asyncio.sleep(0)
        await asyncio.sleep(0)  # (one turn more: any woken later than the first would show now)
        after_one_poll = sorted(woken)
        waiters.freed(3)  # an event: the next oldest three
        for _ in range(5):  # (a woken waiter's task resumes a few loop turns later; the next poll is far)
            await asyncio.sleep(0)
        after_event = sorted(woken)
        waiters.joined()  # a worker joined: everyone
        await asyncio.gather(*tasks)
        return after_one_poll, after_event, len(woken)

    after_one_poll, after_event, total = asyncio.run(scenario())
    assert after_one_poll == list(range(_WAKE_PER_POLL))
    assert after_event == list(range(_WAKE_PER_POLL + 3))
    assert total == 100


def test_a_slow_cluster_refuses_at_once_what_would_wait_past_the_budget():
    """A cluster that admits ~0.4 requests/s (a 135M model on 2 cores): 12 waiting are a 30 s wait, so
    the next request is refused now instead of waiting out the queue timeout; a few are not."""
    clock = FakeClock()
    door = AdmissionDoor(clock)
    for _ in range(_FLOOR - 2):
        door.entered()
    for _ in range(20):  # one admission every 2.5 s, the queue kept as it was
        clock.now += 2.5
        door.left(admitted=True)
        door.entered()
    assert 0.2 < door.rate() < 0.8, door.rate()
    assert door.refuse(budget_s=30.0) is None  # below the floor: a few waiting are never refused
    for _ in range(14):
        door.entered()
    refused = door.refuse(budget_s=30.0)  # 20 waiting at ~0.4/s: ~50 s
    assert refused is not None and refused.retry_after_s > 30.0



def test_a_stall_is_not_a_rate():
    """Admissions stop for a minute (a killed worker not yet declared lost, a pool restarting) while 50
    wait: the rate stays the one measured before, so the door does not refuse what the cluster will admit
    at that rate once it is back (it fell towards 0 and predicted a wait of 10^10 s)."""
    clock = FakeClock()
    door = AdmissionDoor(clock)
    _busy_at_100_per_s(door, clock)
    for _ in range(600):
        clock.now += 0.1
        assert door.refuse(budget_s=1.0) is None  # 50 waiting at ~100/s: half a second
    assert 80 < door.rate() < 110, door.rate()  # the stall's first few intervals counted, then nothing
    # Admitting again, slower: the rate follows the new pace.
    for _ in range(100):
        clock.now += 0.1
        door.left(admitted=True)
        door.entered()
    assert door.rate() < 30, door.rate()
    door.check_integrity()


def test_a_pool_with_no_worker_refuses_nothing_on_the_estimate():
    clock, down = FakeClock(), [False]
    door = AdmissionDoor(clock, short_handed=lambda: down[0])
    _busy_at_100_per_s(door, clock)
    for _ in range(1000):
        door.entered()
    assert door.refuse(budget_s=1.0) is not None  # 1,050 waiting at ~100/s: over ten seconds
    down[0] = True  # every worker of the admitting pool is gone: nothing can be admitted, nor measured
    assert door.refuse(budget_s=1.0) is None
    clock.now += 30
    down[0] = False
    assert door.refuse(budget_s=1.0) is not None and 80 < door.rate() < 110, door.rate()
