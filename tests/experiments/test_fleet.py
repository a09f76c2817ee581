"""The scheduler with fleets of simulated workers (experiments/fleet/): the same scheduler, protocol and
client as a real cluster, at worker counts this box cannot start for real."""

from __future__ import annotations

import random
import threading
import time

import pytest
import ray

from actors.engine.kv.block_hash import PrefixHasher, hash_prompt_blocks
from actors.protocol.request_status import RequestStatus
from actors.protocol.sampling_params import SamplingParams
from cluster.control.scheduler.worker_order import WorkerOrder
from cluster.frontend.client import TandemClient
from experiments.fleet.bench_control_plane import PromptMix
from experiments.fleet.fleet import Fleet, fleet_settings

pytestmark = pytest.mark.slow  # hundreds of simulated workers in host processes


def test_worker_order_reads_the_smallest_keys_as_they_change():
    rng = random.Random(0)
    order, keys = WorkerOrder(), {}
    for step in range(5000):
        wid = f"w{rng.randrange(300)}"
        if rng.random() < 0.1:
            order.discard(wid)
            keys.pop(wid, None)
        else:
            keys[wid] = rng.randrange(50)
            order.set(wid, keys[wid])
        if step % 97 == 0:
            k = rng.randrange(1, 20)
            expected = [w for _, w in sorted((key, w) for w, key in keys.items())[:k]]
            assert order.best(k) == expected
            order.check_integrity()
    assert len(order._heap) <= 4 * len(keys) + 65  # stale entries are compacted away


def test_prefix_hasher_equals_the_block_hash_chain():
    rng = random.Random(1)
    hasher = PrefixHasher(16, "m", capacity=64)  # small: the memo is cleared along the way
    system = [rng.randrange(5000) for _ in range(160)]
    for i in range(200):
        prompt = system[:rng.randrange(161)] + [rng.randrange(5000) for _ in range(rng.randrange(40))]
        salt = rng.choice([None, "", "tenant"])
        assert hasher(prompt, salt) == hash_prompt_blocks(prompt, 16, salt, "m")


def _until_settled(fleet: Fleet, timeout_s: float = 60.0) -> None:
    """The last finish reports reach the scheduler a heartbeat after the last tokens reach the client; fails
    naming what every scheduler shard still has in flight when `timeout_s` runs out."""
    deadline = time.monotonic() + timeout_s
    while in_flight := [state.in_flight for state in fleet.states()]:
        if not any(in_flight):
            return
        assert time.monotonic() < deadline, f"still in flight after {timeout_s:g} s, by shard: {in_flight}"
        time.sleep(0.1)


def _until_in_flight(fleet: Fleet, n: int, timeout_s: float = 60.0) -> None:
    """Until the scheduler shards hold at least `n` requests between them (the load is on the workers)."""
    deadline = time.monotonic() + timeout_s
    while (held := sum(state.in_flight for state in fleet.states())) < n:
        assert time.monotonic() < deadline, f"only {held} requests in flight after {timeout_s:g} s"
        time.sleep(0.05)


def _prompts(n: int, seed: int, systems: int = 4) -> list[list[int]]:
    sample = PromptMix(system_prompts=systems, system_tokens=64, user_tokens=16).sampler(random.Random(seed))
    return [list(sample()) for _ in range(n)]


def test_fleet_of_64_serves_every_request_with_batched_calls(ray_session):
    fleet = Fleet.start(64, per_host=32)
    client = TandemClient(fleet.scheduler)
    try:
        results = client.generate(_prompts(200, seed=2), SamplingParams(max_tokens=6, ignore_eos=True), timeout_s=120)
        for samples in results:
            assert samples[0].status == RequestStatus.FINISHED_LENGTH and len(samples[0].token_ids) == 6
        _until_settled(fleet)
        stats = ray.get(fleet.scheduler.control_stats.remote(), timeout=30)
        assert stats.admitted == 200 and stats.in_flight == 0
        assert stats.prefix_index_entries > 0  # the workers' KV events reached the index
        assert stats.worker_commands > stats.worker_calls  # several commands per call: batched
        fleet.check_integrity()
        state = ray.get(fleet.scheduler.state.remote(), timeout=30)
        assert sum(state.committed_blocks.values()) == 0
        cached = sum(s[0].num_cached_tokens for s in results)
        assert cached > 0  # shared system prompts were routed to workers holding them
    finally:
        client.close()
        fleet.shutdown()


def test_a_tenth_of_256_workers_dying_at_once_loses_no_request(ray_session):
    """One host process killed (16 workers: Ray sees the process die) and 10 workers of other hosts
    stopped (their reports stop: the heartbeat path) at the same moment, under load. No request is lost:
    each one the loss met is re-routed (a prefill that never handed off) or migrated by its client (output
    already streamed), and ends with all its tokens (the failure model's "error when no capacity" never
    applies: 230 workers live on); none hangs, and the scheduler's and every live host's books balance."""
    # Four processes (this box starts Ray workers slowly under load): host 0 holds the 16 that die with it.
    fleet = Fleet.start(256, per_host=(16, 80, 80, 80), settings=fleet_settings(heartbeat_timeout_s=3.0))
    client = TandemClient(fleet.scheduler)
    results: list = []
    params = SamplingParams(max_tokens=60, ignore_eos=True)  # ~1.2 s of decoding: in flight at the kill
    try:
        runner = threading.Thread(target=lambda: results.extend(client.generate(_prompts(600, seed=3), params,
                                                                                 timeout_s=240)))
        runner.start()
        _until_in_flight(fleet, 100)  # placed on the workers: in flight at the kill
        lost = fleet.kill_host(0)
        others = [wid for wid, (host, _) in sorted(fleet.workers.items()) if host != 0]
        stopped = random.Random(4).sample(others, 10)
        fleet.kill(stopped)
        lost += stopped
        runner.join(timeout=300)
        assert not runner.is_alive(), "a request hung"
        assert len(results) == 600
        bad = [(s[0].status, s[0].error) for s in results
               if s[0].status != RequestStatus.FINISHED_LENGTH or len(s[0].token_ids) != 60]
        assert not bad, (len(bad), bad[:5])
        state = ray.get(fleet.scheduler.state.remote(), timeout=30)
        assert not set(lost) & set(state.workers)
        assert state.counters.workers_lost == len(lost) == 26
        # The loss met requests: attempts re-routed by the scheduler or failed over to their clients.
        assert state.counters.rerouted + state.counters.failed > 0, state.counters
        _until_settled(fleet)
        fleet.check_integrity(dead_hosts={0})
        state = ray.get(fleet.scheduler.state.remote(), timeout=30)
        assert state.in_flight == 0 and sum(state.committed_blocks.values()) == 0
    finally:
        client.close()
        fleet.shutdown()


def test_a_restarted_scheduler_rebuilds_its_view_of_512_workers(ray_session):
    """The scheduler dies under load; Ray restarts it empty; all 512 simulated workers find their reports
    unanswered and register again with the requests they hold; the clients' audit migrates what only
    the dead scheduler knew. Every request ends with all its tokens, and the books balance."""
    fleet = Fleet.start(512, per_host=128, settings=fleet_settings(heartbeat_timeout_s=2.0), restartable=True)
    client = TandemClient(fleet.scheduler, audit_s=1.0)
    results: list = []
    params = SamplingParams(max_tokens=60, ignore_eos=True)
    try:
        runner = threading.Thread(target=lambda: results.extend(client.generate(_prompts(400, seed=5), params,
                                                                                 timeout_s=240)))
        runner.start()
        _until_in_flight(fleet, 100)  # the dead scheduler holds requests its successor must learn
        ray.kill(fleet.scheduler, no_restart=False)
        runner.join(timeout=300)
        assert not runner.is_alive(), "a request hung"
        assert len(results) == 400
        bad = [(s[0].status, s[0].error) for s in results
               if s[0].status != RequestStatus.FINISHED_LENGTH or len(s[0].token_ids) != 60]
        assert not bad, bad[:5]
        fleet.wait_registered(set(fleet.workers), timeout_s=60)
        _until_settled(fleet)
        fleet.check_integrity()
        state = ray.get(fleet.scheduler.state.remote(), timeout=30)
        assert len(state.workers) == 512 and state.in_flight == 0 and sum(state.committed_blocks.values()) == 0
    finally:
        client.close()
        fleet.shutdown()


def test_two_scheduler_shards_split_the_load_and_survive_a_host_across_both(ray_session):
    """Two scheduler actors, each with half of each pool; the client sends a request to the shard its
    prompt's first tokens hash to (requests sharing a system prompt meet there, and hit its cache).
    A host whose workers belong to both shards dies under load: each shard routes around its own,
    every request ends, and both shards' books balance."""
    fleet = Fleet.start(128, per_host=(16, 56, 56), settings=fleet_settings(heartbeat_timeout_s=3.0), shards=2)
    client = TandemClient(fleet.schedulers)
    results: list = []
    params = SamplingParams(max_tokens=60, ignore_eos=True)
    try:
        prompts = _prompts(400, seed=6, systems=16)
        runner = threading.Thread(target=lambda: results.extend(client.generate(prompts, params, timeout_s=240)))
        runner.start()
        _until_in_flight(fleet, 100)  # placed on the workers: in flight at the kill
        lost = fleet.kill_host(0)
        runner.join(timeout=300)
        assert not runner.is_alive(), "a request hung"
        finished = [s[0] for s in results if s[0].status == RequestStatus.FINISHED_LENGTH]
        assert len(results) == 400 and all(len(s.token_ids) == 60 for s in finished)
        assert all(s[0].error for s in results if s[0].status != RequestStatus.FINISHED_LENGTH)
        assert sum(s.num_cached_tokens for s in finished) > 0
        for state in fleet.states():
            assert state.counters.workers_lost == 8  # the dead host's 16 workers were half of each shard's
            assert not set(lost) & set(state.workers)
        stats = [ray.get(s.control_stats.remote(), timeout=30) for s in fleet.schedulers]
        assert all(st.admitted > 50 for st in stats), [st.admitted for st in stats]  # both took a share
        _until_settled(fleet)
        fleet.check_integrity(dead_hosts={0})
        assert all(st.in_flight == 0 and not sum(st.committed_blocks.values()) for st in fleet.states())
    finally:
        client.close()
        fleet.shutdown()
