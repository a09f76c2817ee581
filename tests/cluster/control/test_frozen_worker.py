"""A worker process frozen with SIGSTOP: alive to Ray (its watch call never fails), silent to the
scheduler (no report, no pulse), at the liveness bounds configs/local.yaml ships (1 prefill + 1 decode
worker; KV test-sized): frozen in the prefill phase, during a KV handoff, and while decoding.

What the README's "Failures" paragraph promises, checked for each: the worker is declared lost after
`scheduler.heartbeat_timeout_s` of silence (not before, and not much after), every stream it served goes on
elsewhere and ends with the single-process engine's greedy tokens, and none is silent for
`scheduler.progress_timeout_s`. Then the frozen process gets SIGCONT: it registers again as the same
incarnation, and its stale attempts are fenced: what they still send the client is neither shown nor
counted (the client received exactly the tokens it shows), the scheduler tracks none of them, and no KV is
left on any worker.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import ray

from actors.engine.engine import Engine
from actors.protocol.messages import TokenDelta
from actors.protocol.request_status import RequestStatus
from actors.protocol.sampling_params import SamplingParams
from cluster.control.lifecycle.launch import Cluster
from cluster.frontend.client import TandemClient
from cluster.frontend.open_client import open_client
from cluster.frontend.inbox import Inbox
from experiments.chaos_killer import alive_worker_pids
from tests.helpers.cluster import load, wait_until_idle

pytestmark = pytest.mark.slow  # each freeze lasts the shipped heartbeat timeout

CONFIG = load("local.yaml")  # heartbeat, progress and lease bounds as shipped
BOUNDS = CONFIG.scheduler
# Longer than the decode worker may prefill itself: it goes to the prefill worker.
LONG_PROMPT = [10 + (7 * i) % 1900 for i in range(BOUNDS.local_prefill_max_tokens + 88)]
SHORT_PROMPT = [20 + (13 * i) % 1900 for i in range(40)]
MAX_TOKENS = 400
# A silent worker's last pulse may come before the freeze: pulses come every 0.25 s, later on a busy box.
PULSE_SLACK_S = 2.0
# How long past the timeout the scheduler may take to notice (its watch runs every 0.5 s; its event loop
# and this test's polling share two busy cores).
NOTICE_S = 10.0
# The prefill worker's next step waits this long before it computes (the `slow_step` fault), as a long
# prefill on a slow CPU does: the stop, a moment after the prompt is placed, comes before its prefill ends.
PREFILL_HOLD_S = 3.0


@pytest.fixture(scope="module")
def expected():
    engine = Engine(CONFIG.engine_config())
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return {name: r.outputs[0].token_ids for name, r in
            zip(("long", "short"), engine.generate([LONG_PROMPT, SHORT_PROMPT], params))}


@pytest.fixture
def cluster(ray_session):
    """A fresh cluster for each test: no worker has measured a prefill or a handoff yet, so its first prompts
    are routed by the configured costs alone (the long one to the prefill worker, a short one beside it to
    the decode worker), as each test needs."""
    cluster = Cluster.start(CONFIG)
    yield cluster
    cluster.shutdown()


@pytest.fixture
def freezer():
    freezer = Freezer()
    yield freezer
    freezer.thaw_all()


class Freezer:
    """Stops worker processes (SIGSTOP) and continues them (SIGCONT); `thaw_all` continues whatever is still
    stopped, however a test ends. Only Ray's actor table is asked for a process id: a call to a stopped worker
    would wait for it."""

    def __init__(self):
        self._stopped: dict[str, int] = {}

    def freeze(self, worker_id: str) -> float:
        pid = alive_worker_pids()[worker_id]
        os.kill(pid, signal.SIGSTOP)
        self._stopped[worker_id] = pid
        return time.monotonic()

    def thaw(self, worker_id: str) -> float:
        os.kill(self._stopped.pop(worker_id), signal.SIGCONT)
        return time.monotonic()

    def thaw_all(self) -> None:
        for worker_id in list(self._stopped):
            self.thaw(worker_id)


class Tap(Inbox):
    """A request's inbox that also keeps every delta that reached it, with when it came."""

    def __init__(self, loop):
        super().__init__(loop)
        self.deltas: list[tuple[float, TokenDelta]] = []

    def put(self, item) -> None:
        if isinstance(item, TokenDelta):
            self.deltas.append((time.monotonic(), item))
        super().put(item)

    def given_up(self) -> set:
        """Attempts the client was told it is done with: failed with its worker (it moves the request), or
        placed again by the scheduler."""
        return {d.attempt for _, d in self.deltas if d.superseded or (d.status == RequestStatus.FAILED and d.retryable)}

    def stale_after(self, since: float) -> list[TokenDelta]:
        """Deltas that came after `since` from attempts the client had been told to give up."""
        return [d for at, d in self.deltas if at > since and d.attempt in self.given_up() and not d.superseded]

    def longest_silence_s(self, sent: float, ended: float) -> float:
        """The longest time the request went without tokens from a live attempt (from its submit to its end)."""
        given_up = self.given_up()
        times = [sent] + [at for at, d in self.deltas if d.token_ids and d.attempt not in given_up] + [ended]
        return max(b - a for a, b in zip(times, times[1:]))


class Reader:
    """Reads one request's events on a thread of its own. `hold` stops reading (its deltas wait in its inbox,
    and the stream stays open however far the cluster got) until `go`."""

    def __init__(self, client: TandemClient, prompt: list[int]):
        self.sent = time.monotonic()
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
        self.submitted = client.submit(prompt, params, deltas=Tap(client._loop))  # the client's own event loop
        self.tokens = 0
        self.ended: float | None = None
        self.error: BaseException | None = None
        self._reading = threading.Event()
        self._reading.set()
        self._thread = threading.Thread(target=self._read, args=(client,), daemon=True)
        self._thread.start()

    @property
    def stream(self):
        return self.submitted.stream

    @property
    def route(self) -> tuple[str, bool]:
        return self.submitted.route.prefill, self.submitted.route.local

    def _read(self, client: TandemClient) -> None:
        try:
            for event in client.events(self.submitted, timeout_s=600):
                self.tokens += len(event.token_ids)
                self._reading.wait()
        except BaseException as exc:  # reported by `result`
            self.error = exc
        self.ended = time.monotonic()

    def hold(self) -> None:
        self._reading.clear()

    def go(self) -> None:
        self._reading.set()

    def wait_tokens(self, n: int, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while self.tokens < n:
            assert self._thread.is_alive(), (self.error, self.stream.results)
            assert time.monotonic() < deadline, f"{self.tokens} of {n} tokens within {timeout_s}s"
            time.sleep(0.005)

    def assert_exact(self, want: list[int], moves: int) -> None:
        """The stream ended with the engine's greedy tokens, moved by its client `moves` times, never without
        tokens for the progress bound; nothing a fenced attempt sent counted: it received what it shows."""
        self._thread.join(BOUNDS.progress_timeout_s * 2)
        assert not self._thread.is_alive(), f"the stream did not end in time: {self.stream.results}"
        assert self.error is None, self.error
        (result,) = self.stream.results
        assert result.finish_reason == "length", result.error
        assert result.token_ids == want
        assert self.stream.received_tokens == len(want), (self.stream.received_tokens, len(want))
        assert self.stream.moves == moves
        silence = self.stream.inbox.longest_silence_s(self.sent, self.ended)
        assert silence < BOUNDS.progress_timeout_s, silence


def state(cluster: Cluster):
    return ray.get(cluster.scheduler.state.remote(), timeout=30)


def wait_declared_lost(cluster: Cluster, worker_id: str, since: float, lost_before: int) -> None:
    """Until the scheduler routes around the worker; it must have taken the heartbeat timeout: not less,
    and not much more."""
    deadline = since + BOUNDS.heartbeat_timeout_s + NOTICE_S
    while worker_id in (now := state(cluster)).workers:
        assert time.monotonic() < deadline, f"{worker_id} still routed to {NOTICE_S}s past the heartbeat timeout"
        time.sleep(0.05)
    took = time.monotonic() - since
    assert now.counters.workers_lost == lost_before + 1, now.counters
    assert took >= BOUNDS.heartbeat_timeout_s - PULSE_SLACK_S, f"declared lost after {took:.1f}s of silence"


def wait_back(cluster: Cluster, worker_id: str, incarnation: str) -> None:
    """The woken worker registers again, as the same process."""
    cluster.wait_registered({worker_id}, timeout_s=60)
    assert state(cluster).incarnations[worker_id] == incarnation


def assert_no_kv_left(cluster: Cluster) -> dict:
    report = wait_until_idle(cluster, timeout_s=60)
    for wid, stats in report["workers"].items():
        assert stats["reserved"] == stats["held"] == stats["used_blocks"] == stats["live_requests"] == 0, (wid, stats)
    assert report["scheduler"]["in_flight"] == 0, report["scheduler"]
    return report


def test_a_decode_worker_frozen_while_decoding_and_during_a_handoff(cluster, expected, freezer):
    """decode-0 stops while one stream decodes on it and another's pages are on their way to it (its
    prefill worker, stopped for a moment as a gate, goes on once decode-0 has stopped): both move, and go on
    on decode-0 once it wakes (the only decode worker) as new attempts; the old ones are fenced."""
    client = open_client(cluster)
    before = state(cluster)
    freezer.freeze("prefill-0")  # holds the long prompt's prefill until decode-0 has stopped
    handing_off = Reader(client, LONG_PROMPT)  # admitted: decode-0 has reserved its blocks
    assert handing_off.route == ("prefill-0", False)
    decoding = Reader(client, SHORT_PROMPT)  # prefilled on decode-0 itself: prefill-0 has a queue
    assert decoding.route == ("decode-0", True)
    decoding.wait_tokens(2, timeout_s=120)  # decode-0 is decoding it
    stopped = freezer.freeze("decode-0")
    # prefill-0 goes on: it computes the long prompt and sends its pages to the stopped decode-0 (the send
    # waits for a peer that cannot answer, up to its deadline; the first token leaves after it).
    freezer.thaw("prefill-0")
    wait_declared_lost(cluster, "decode-0", stopped, before.counters.workers_lost)
    woke = freezer.thaw("decode-0")
    wait_back(cluster, "decode-0", before.incarnations["decode-0"])
    decoding.assert_exact(expected["short"], moves=1)
    handing_off.assert_exact(expected["long"], moves=1)
    # decode-0 woke in the middle of the old attempt's step and went on decoding it: fenced at the client.
    assert decoding.stream.inbox.stale_after(woke), decoding.stream.inbox.deltas
    # The long prompt's first attempt got as far as its handoff: its first token leaves prefill-0 once the
    # send to the stopped decode-0 has returned (delivered or timed out), after it was given up.
    first = next(d for _, d in handing_off.stream.inbox.deltas if d.status == RequestStatus.TRANSFERRING)
    assert first.attempt in handing_off.stream.inbox.given_up()
    assert state(cluster).counters.workers_lost == before.counters.workers_lost + 1  # prefill-0 was not lost
    assert_no_kv_left(cluster)


def test_a_prefill_worker_frozen_with_a_prompt_to_prefill(cluster, expected, freezer):
    """prefill-0 stops before it has prefilled a long prompt placed on it (its blocks reserved on decode-0):
    once prefill-0 is declared lost the scheduler prefills the prompt again on decode-0 (nothing had reached
    the client: it sees only latency, no move). prefill-0 wakes while the stream still runs and finishes the
    old attempt's step: its first token reaches the stream, which must not take it, and its pages reach
    decode-0, which must refuse them (their reservation was released)."""
    client = open_client(cluster)
    before = state(cluster)
    ray.get(cluster.workers["prefill-0"].inject_fault.remote("slow_step", PREFILL_HOLD_S), timeout=30)
    prefilling = Reader(client, LONG_PROMPT)
    assert prefilling.route == ("prefill-0", False)
    stopped = freezer.freeze("prefill-0")
    wait_declared_lost(cluster, "prefill-0", stopped, before.counters.workers_lost)
    prefilling.wait_tokens(1, timeout_s=BOUNDS.progress_timeout_s)  # prefilled again, on decode-0
    prefilling.hold()  # the stream stays open until the old attempt's token has come
    woke = freezer.thaw("prefill-0")
    deadline = woke + BOUNDS.progress_timeout_s
    # Only the old attempt hands off: the new one runs whole on decode-0.
    while not (handed := [d for at, d in prefilling.stream.inbox.deltas if d.status == RequestStatus.TRANSFERRING]):
        assert time.monotonic() < deadline, prefilling.stream.inbox.deltas
        time.sleep(0.01)
    prefilling.go()
    assert handed == prefilling.stream.inbox.stale_after(woke) and len(handed[0].token_ids) == 1, handed
    wait_back(cluster, "prefill-0", before.incarnations["prefill-0"])
    prefilling.assert_exact(expected["long"], moves=0)
    after = state(cluster).counters
    assert (after.rerouted, after.workers_lost) == (before.counters.rerouted + 1, before.counters.workers_lost + 1)
    report = assert_no_kv_left(cluster)
    assert report["workers"]["decode-0"]["late_pages_dropped"] == 1  # the old attempt's pages, refused
