"""No stream stays silent past the progress bound, at the shipped bound (`scheduler.progress_timeout_s`,
60 s): a request whose every worker is frozen in a step longer than the bound (alive: its pulse speaks,
its engine thread says nothing) is moved at half the bound and ends with a clean error just before the
bound, never a token, never longer silent; an HTTP request whose admission gets no answer within the bound
(its scheduler's process stopped, SIGSTOP) is a 503 at the bound. The shortened bound's test of the same
code is test_stuck_engine.py (4 s); the client's arithmetic alone is test_request_stream.py."""

from __future__ import annotations

import os
import signal
import threading
import time

import httpx
import pytest
import ray

from actors.protocol.sampling_params import SamplingParams
from cluster.control.config import SchedulerSection
from cluster.control.lifecycle.launch import Cluster
from cluster.frontend.open_client import open_client
from tests.helpers.cluster import load, wait_until_idle
from tests.helpers.http_server import MODEL, serving

pytestmark = pytest.mark.slow  # a minute of silence at the shipped bound, then the frozen steps' end

BOUND_S = SchedulerSection().progress_timeout_s
# Longer than the bound: a worker in this step never answers within it.
FROZEN_S = BOUND_S + 5.0
# How late a decision may be seen past its time: the client's event loop (a thread of this process) and
# this test's poll on a busy 2-core box.
LATE_S = 2.0
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def test_a_request_no_worker_answers_is_moved_at_half_the_bound_and_ends_at_it(ray_session):
    config = load("local.yaml")
    assert config.scheduler.progress_timeout_s == BOUND_S  # as shipped
    cluster = Cluster.start(config)
    try:
        # Both workers: wherever the request (or its move) is placed, its step is frozen.
        for worker in cluster.workers.values():
            ray.get(worker.inject_fault.remote("slow_step", FROZEN_S), timeout=30)
            ray.get(worker.check_integrity.remote(), timeout=30)  # the fault is in place (same inbox, in order)
        client = open_client(cluster)
        assert client.progress_timeout_s == BOUND_S
        handle = client.submit(list(range(700, 740)), GREEDY)
        stream, out = handle.stream, {}

        def read() -> None:
            out["events"] = list(client.events(handle, timeout_s=10 * BOUND_S))  # its deadline far away
            out["ended"] = time.monotonic()

        reader = threading.Thread(target=read)
        reader.start()
        moved = None
        while reader.is_alive():  # the reader ends at the bound at the latest, else the wait fails
            if moved is None and stream.moves:
                moved = time.monotonic()
            assert time.monotonic() - stream.started < BOUND_S + 30, "the stream is still open past the bound"
            time.sleep(0.05)
        reader.join()
        events = out["events"]
        assert moved is not None, "never moved"
        moved_s, ended_s = moved - stream.started, out["ended"] - stream.started
        print(f"bound {BOUND_S:g} s: moved at {moved_s:.2f} s, ended at {ended_s:.2f} s; moves {stream.moves}, "
              f"stalls {stream.stalls}")
        assert BOUND_S / 2 <= moved_s <= BOUND_S / 2 + LATE_S, moved_s
        assert BOUND_S - 1.0 <= ended_s <= BOUND_S + LATE_S, ended_s
        (last,) = events
        assert last.finished and last.finish_reason == "error" and not last.token_ids, last
        assert "made no progress" in last.error and "also after it was moved" in last.error, last.error
        # Moved at half the bound and ended at it. The first attempt's KV reservation (lease_s, 30 s as shipped)
        # runs out at the same time as half the bound: when it fails first, it moves the request too.
        assert stream.received_tokens == 0 and stream.stalls == 2 and stream.moves in (1, 2), (
            stream.received_tokens, stream.stalls, stream.moves)
        # The frozen steps end (FROZEN_S after each began: the moved attempt's at half the bound, so up to
        # BOUND_S / 2 + FROZEN_S in); then the workers' copies are stopped and nothing stays held.
        for worker in cluster.workers.values():
            ray.get(worker.inject_fault.remote(None), timeout=30)
        frozen_until = stream.started + BOUND_S / 2 + LATE_S + FROZEN_S
        for worker in cluster.workers.values():
            _integrity_once_unfrozen(worker, frozen_until + 30)
        cluster.wait_registered(set(cluster.workers), timeout_s=60)
        wait_until_idle(cluster)
    finally:
        cluster.shutdown()


def _integrity_once_unfrozen(worker, deadline: float) -> None:
    """The worker's integrity check, asked again while its engine thread is still in a frozen step: a worker
    answers it between steps only and gives up after its own 30 s (actor.py's _CALL_TIMEOUT_S). Fails once
    `deadline` (time.monotonic()) has passed."""
    while True:
        try:
            ray.get(worker.check_integrity.remote(), timeout=60)
            return
        except ray.exceptions.RayTaskError as exc:
            if not isinstance(exc.cause, TimeoutError) or time.monotonic() > deadline:
                raise


def test_an_admission_unanswered_for_the_bound_is_a_503_at_the_bound(ray_session):
    config = load("local.yaml")
    assert config.scheduler.progress_timeout_s == BOUND_S  # as shipped
    with serving(config) as (cluster, url):
        pid = ray.get(cluster.scheduler.__ray_call__.remote(lambda _: os.getpid()), timeout=30)
        os.kill(pid, signal.SIGSTOP)  # alive to Ray, silent to its clients
        try:
            sent = time.monotonic()
            answer = httpx.post(url + "/v1/completions", timeout=BOUND_S + 60, json={
                "model": MODEL, "prompt": "Hello", "max_tokens": 4, "temperature": 0})
            answered_s = time.monotonic() - sent
        finally:
            os.kill(pid, signal.SIGCONT)
        print(f"bound {BOUND_S:g} s: 503 after {answered_s:.2f} s")
        assert answer.status_code == 503 and answer.headers["retry-after"], answer.text
        assert "no admission answer within the progress bound" in answer.json()["error"]["message"], answer.text
        assert BOUND_S - 0.5 <= answered_s <= BOUND_S + LATE_S, answered_s
        # The scheduler, running again, hears from its workers again; nothing stays held.
        cluster.wait_registered(set(cluster.workers), timeout_s=60)
        wait_until_idle(cluster)
