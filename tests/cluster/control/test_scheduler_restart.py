"""The scheduler actor dies and Ray restarts it: it rebuilds its view from the workers' re-registration.

Streams already running finish with the fault-free output (tokens flow worker -> client, not through
the scheduler); a request cancelled after the restart still reaches its worker; new requests are
admitted again; nothing leaks.
"""

from __future__ import annotations

import threading
import time

import pytest
import ray

from actors.engine.engine import Engine
from actors.protocol.sampling_params import SamplingParams
from cluster.control.lifecycle.launch import Cluster
from cluster.control.config import TandemConfig
from cluster.frontend.open_client import open_client
from tests.helpers.cluster import load, wait_until_idle
from tests.helpers.models import make_hf_model

pytestmark = pytest.mark.slow  # scheduler kills, a cluster each

LONG = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
# Longer than any scheduler restart takes on a loaded box: a cancel must be what ends it. (The default
# tiny model's 2,048-token context decodes in ~6 s, as long as a restart took under CI's load.)
ENDLESS = SamplingParams(temperature=0.0, max_tokens=30_000, ignore_eos=True)


@pytest.fixture(scope="module")
def config(tmp_path_factory) -> TandemConfig:
    """configs/local.yaml on a tiny random Llama with a 32k context, for ENDLESS."""
    model = make_hf_model(tmp_path_factory.mktemp("long-context"), "llama", with_tokenizer=True,
                          vocab_size=2048, max_position_embeddings=32_768)
    config = load("local.yaml", num_kv_blocks=2048)
    return config.model_copy(update={
        "model": config.model.model_copy(update={"path": str(model)}),
        "scheduler": config.scheduler.model_copy(update={"heartbeat_timeout_s": 2.0, "local_prefill": False,
                                                         "lease_s": 5.0})})


@pytest.fixture(scope="module")
def cluster(ray_session, config):
    cluster = Cluster.start(config)
    yield cluster
    cluster.shutdown()


def assert_idle(cluster: Cluster) -> None:
    state = wait_until_idle(cluster)
    for stats in state["workers"].values():
        assert stats["used_blocks"] == stats["reserved"] == stats["held"] == stats["live_requests"] == 0, stats
    assert state["scheduler"]["in_flight"] == 0


def scheduler_state(cluster: Cluster) -> dict | None:
    try:
        return ray.get(cluster.scheduler.state.remote(), timeout=10).as_dict()
    except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):  # restarting (slowly, under load)
        return None


def kill_scheduler_and_wait(cluster: Cluster, kill: bool = True) -> float:
    """Seconds from the kill until the restarted scheduler knows every worker again."""
    if kill:
        ray.kill(cluster.scheduler, no_restart=False)  # Ray restarts it, empty
    start = time.monotonic()
    while True:
        state = scheduler_state(cluster)
        # A fresh incarnation has admitted nothing yet; the old one may answer until the kill lands.
        if state is not None and state["counters"]["submitted"] == 0 and set(state["workers"]) == set(cluster.workers):
            return time.monotonic() - start
        assert time.monotonic() - start < 120, "the workers never registered with the restarted scheduler"
        time.sleep(0.05)


def test_running_streams_finish_across_a_scheduler_restart(cluster, config):
    prompts = [list(range(40 + i, 70 + i)) for i in range(3)]
    expected = [r.outputs[0].token_ids for r in Engine(config.engine_config()).generate(prompts, LONG)]
    client = open_client(cluster)
    streams = [client.stream(p, LONG, timeout_s=120) for p in prompts]
    events = [[next(s)] for s in streams]  # each has its first token: all are past admission
    kill_scheduler_and_wait(cluster)
    for s, evs in zip(streams, events):
        evs.extend(s)
    for evs, want in zip(events, expected):
        assert evs[-1].finish_reason == "length", evs[-1]
        assert [t for ev in evs for t in ev.token_ids] == want
    # Rebuilt from re-registration: new requests are admitted and served.
    (after,) = client.generate([prompts[0]], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))[0]
    assert after.token_ids == expected[0][:8]
    assert_idle(cluster)


def test_streams_lost_with_the_scheduler_and_their_worker_are_migrated(cluster, config):
    """The scheduler and the decode worker die in the same moment: no scheduler sees the worker go, and
    the restarted one never hears of its requests (the worker comes back empty). The client's audit
    finds them once the new scheduler has settled, and they migrate: the fault-free output, no hang."""
    lose_the_scheduler_and_a_decode_worker(cluster, config)


def lose_the_scheduler_and_a_decode_worker(cluster: Cluster, config: TandemConfig, timeout_s: float = 60) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=1500, ignore_eos=True)
    prompts = [list(range(500 + i, 530 + i)) for i in range(2)]
    expected = [r.outputs[0].token_ids for r in Engine(config.engine_config()).generate(prompts, params)]
    client = open_client(cluster)
    streams = [client.stream(p, params, timeout_s=timeout_s) for p in prompts]
    events = [[next(s)] for s in streams]
    ray.kill(cluster.scheduler, no_restart=False)  # first: the old scheduler must not see the worker die
    ray.kill(cluster.workers["decode-0"], no_restart=False)
    kill_scheduler_and_wait(cluster, kill=False)
    for s, evs in zip(streams, events):
        evs.extend(s)
    for evs, want in zip(events, expected):
        assert evs[-1].finish_reason == "length", evs[-1]
        assert [t for ev in evs for t in ev.token_ids] == want
    assert_idle(cluster)


def test_a_submit_the_scheduler_died_under_is_sent_again_and_runs_once(cluster, config):
    """The scheduler dies while a submit waits for admission (its decode worker drained): the client
    sends it again, marked as a retry, and the restarted scheduler admits it once it has heard from
    every worker; the request runs once, with the fault-free output."""
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    prompt = list(range(700, 740))
    (expected,) = [r.outputs[0].token_ids for r in Engine(config.engine_config()).generate([prompt], params)]
    client = open_client(cluster)
    ray.get(cluster.scheduler.drain.remote("decode-0"), timeout=30)  # admission now waits (queue_timeout_s)
    outcome: dict = {}

    def submit() -> None:
        try:
            (r,) = client.generate([prompt], params, timeout_s=120)[0]
            outcome["tokens"], outcome["finish_reason"] = r.token_ids, r.finish_reason
        except Exception as exc:
            outcome["error"] = repr(exc)

    thread = threading.Thread(target=submit, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while scheduler_state(cluster)["counters"]["submitted"] == 0:  # it waits inside the scheduler
        assert time.monotonic() < deadline, "the submit never reached the scheduler"
        time.sleep(0.02)
    ray.kill(cluster.scheduler, no_restart=False)  # the restarted scheduler does not know the drain
    thread.join(timeout=120)
    assert outcome.get("tokens") == expected and outcome["finish_reason"] == "length", outcome
    assert_idle(cluster)  # the worker's finish report has reached the scheduler too
    counters = scheduler_state(cluster)["counters"]
    assert counters["submitted"] == 1 and counters["finished"] == 1, counters


def test_a_cancel_after_the_restart_reaches_the_worker(cluster):
    client = open_client(cluster)
    stream = client.stream(list(range(100, 140)), ENDLESS, timeout_s=120)
    next(stream)
    kill_scheduler_and_wait(cluster)
    # The restarted scheduler learned the request from the decode worker's live list.
    deadline = time.monotonic() + 10
    while scheduler_state(cluster)["in_flight"] != 1:
        assert time.monotonic() < deadline, "the restarted scheduler never learned the running request"
        time.sleep(0.05)
    next(stream)
    stream.close()  # the client stops reading: abort through the rebuilt scheduler
    assert_idle(cluster)


def test_a_cancel_sent_while_the_scheduler_is_down_reaches_the_worker(cluster):
    """The client hangs up while no scheduler runs: the request is stopped, not run to its end.
    (Ray holds a call to a restarting actor, so here the abort usually lands after the worker has
    announced the request; the client's resend and the scheduler's memory of early aborts cover the
    abort that fails or comes first.)"""
    client = open_client(cluster)
    stream = client.stream(list(range(300, 340)), ENDLESS, timeout_s=120)
    next(stream)
    ray.kill(cluster.scheduler, no_restart=False)
    deadline = time.monotonic() + 120

    def fresh() -> dict | None:  # the restarted incarnation's state (it has admitted nothing), else None
        state = scheduler_state(cluster)
        return state if state is not None and state["counters"]["submitted"] == 0 else None

    while scheduler_state(cluster) is not None and fresh() is None:  # until the old incarnation is gone
        assert time.monotonic() < deadline
        time.sleep(0.01)
    stream.close()
    while True:
        state = fresh()
        if state is not None and state["counters"]["cancelled"] == 1 and state["in_flight"] == 0:
            break
        assert state is None or state["counters"]["finished"] == 0, "the cancelled request ran to its end"
        assert time.monotonic() < deadline, state
        time.sleep(0.1)
    cluster.wait_registered(set(cluster.workers), timeout_s=60)
    assert_idle(cluster)


def test_requests_submitted_during_the_restart_finish_or_fail_clearly(cluster):
    """Submitted while the scheduler is down: Ray holds the call until the actor is back (or it fails
    with a clear actor error); nothing hangs past its timeout."""
    client = open_client(cluster)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    ray.kill(cluster.scheduler, no_restart=False)
    outcomes = []
    for i in range(4):
        try:
            (r,) = client.generate([list(range(200 + i, 260 + i))], params, timeout_s=60)[0]
            outcomes.append(r.finish_reason)
        except ray.exceptions.RayError as exc:
            outcomes.append(type(exc).__name__)
    assert outcomes[-1] == "length", outcomes
    assert all(o in ("length", "ActorDiedError", "ActorUnavailableError", "RayActorError") for o in outcomes), outcomes
    cluster.wait_registered(set(cluster.workers), timeout_s=60)
    assert_idle(cluster)
