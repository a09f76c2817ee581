"""Routing: the cost model in isolation, then acceptance 2 on a live 2P+1D cluster."""

from __future__ import annotations

import pytest
import torch

from actors.protocol.sampling_params import SamplingParams
from cluster.control.lifecycle.launch import Cluster
from cluster.control.scheduler.routing import ANY_TENANT, RecentTenants, WorkerView, pick_decode, plan_prefill, predicted_ttft
from cluster.frontend.open_client import open_client
from tests.helpers.cluster import load, wait_until_idle, wait_until_reported

COST = 1e-3


def views(queue_a=0, queue_b=0):
    return [WorkerView("prefill-a", "prefill", 100, 100, queued_prefill_tokens=queue_a),
            WorkerView("prefill-b", "prefill", 100, 100, queued_prefill_tokens=queue_b)]


def test_cache_aware_prefers_the_worker_holding_the_prefix():
    plan = plan_prefill("cache_aware", views(), {"prefill-b": 256}, 300, 0.0, COST, turn=0)
    assert (plan.worker_id, plan.cached_tokens) == ("prefill-b", 256)
    assert plan.predicted_ttft_s == pytest.approx(44 * COST)


def test_cache_aware_avoids_a_cached_worker_whose_queue_is_slower():
    # b: 400 queued + 44 uncached = 444 tokens of work; a: 300 uncached.
    plan = plan_prefill("cache_aware", views(queue_b=400), {"prefill-b": 256}, 300, 0.0, COST, turn=0)
    assert plan.worker_id == "prefill-a"
    assert plan.predicted_ttft_s == pytest.approx(300 * COST)


def test_measured_costs_and_transfer_time_enter_the_prediction():
    a, b = views()
    b.prefill_s_per_token = 10 * COST  # a slow worker loses even with the whole prefix cached
    plan = plan_prefill("cache_aware", [a, b], {"prefill-b": 256}, 300, 0.05, COST, turn=0)
    assert plan.worker_id == "prefill-a" and plan.predicted_ttft_s == pytest.approx(300 * COST + 0.05)


def test_local_prefill_when_the_decode_worker_is_much_faster():
    decode = WorkerView("decode-0", "decode", 100, 100)
    remote_busy = views(queue_a=5000, queue_b=5000)
    plan = plan_prefill("cache_aware", remote_busy, {"decode-0": 96}, 100, 0.01, COST, 0, local=decode, local_penalty=1.0)
    assert plan.local and plan.worker_id == "decode-0"
    idle = plan_prefill("cache_aware", views(), {}, 100, 0.0, COST, 0, local=decode, local_penalty=1.0)
    assert not idle.local  # equal predictions: the penalty keeps the prefill remote


def test_another_tenants_flood_counts_only_as_far_as_the_worker_would_serve_it_first():
    """Batchers take tenants in turn: behind tenant a's 10,000 queued tokens, b's 100-token prompt waits for
    about as much of a's work as its own (100), not all of it; a's own prompt waits for everything."""
    flooded = WorkerView("prefill-a", "prefill", 100, 100, queued_prefill_tokens=10_000, queued_by_tenant={"a": 10_000})
    assert predicted_ttft(flooded, 100, 0, COST, 0.0) == pytest.approx(10_100 * COST)  # first come, first served
    assert predicted_ttft(flooded, 100, 0, COST, 0.0, "b") == pytest.approx(200 * COST)
    assert predicted_ttft(flooded, 100, 0, COST, 0.0, "a") == pytest.approx(10_100 * COST)
    busy_with_b = WorkerView("prefill-b", "prefill", 100, 100, queued_prefill_tokens=3_000, queued_by_tenant={"b": 3_000})
    fifo = plan_prefill("cache_aware", [flooded, busy_with_b], {}, 100, 0.0, COST, 0)
    fair = plan_prefill("cache_aware", [flooded, busy_with_b], {}, 100, 0.0, COST, 0, tenant="b")
    assert (fifo.worker_id, fair.worker_id) == ("prefill-b", "prefill-a")
    assert fair.predicted_ttft_s == pytest.approx(200 * COST)


def test_another_tenants_step_in_flight_is_waited_out_whole():
    """A prefill step is no one's to share: behind a's flood, b's 8-token prompt may wait a whole step of a's
    (2,048 tokens here), so it is prefilled on the decode worker, though that worker's measured cost per
    token (short prompts: the step's overhead) is ten times the prefill worker's."""
    flooded = WorkerView("prefill-a", "prefill", 100, 100, queued_prefill_tokens=24_000, queued_by_tenant={"a": 24_000},
                         prefill_s_per_token=COST)
    decode = WorkerView("decode-0", "decode", 100, 100, prefill_s_per_token=10 * COST)
    assert predicted_ttft(flooded, 8, 0, COST, 0.0, "b", step_tokens=2048) == pytest.approx(2056 * COST)
    assert predicted_ttft(flooded, 8, 0, COST, 0.0, "b", step_tokens=4) == pytest.approx(16 * COST)  # the fair share
    without = plan_prefill("cache_aware", [flooded], {}, 8, 0.001 * COST, COST, 0, local=decode, local_penalty=1.0,
                           local_max_tokens=512, tenant="b")
    with_step = plan_prefill("cache_aware", [flooded], {}, 8, 0.001 * COST, COST, 0, local=decode, local_penalty=1.0,
                             local_max_tokens=512, tenant="b", step_tokens=2048)
    assert (without.local, with_step.local) == (False, True)
    assert with_step.predicted_ttft_s == pytest.approx(80 * COST)
    # a's own prompt waits for its whole queue either way; nobody else's step is in flight for it
    assert predicted_ttft(flooded, 8, 0, COST, 0.0, "a", step_tokens=2048) == pytest.approx(24_008 * COST)


def test_a_long_uncached_prompt_is_never_prefilled_on_the_decode_worker():
    """However deep the prefill queues, a decode worker does not take a prefill longer than the bound: its
    step would stall every token it decodes meanwhile (and every reservation asked of it)."""
    decode = WorkerView("decode-0", "decode", 1000, 1000)
    remote_busy = views(queue_a=50_000, queue_b=50_000)
    long = plan_prefill("cache_aware", remote_busy, {}, 2000, 0.01, COST, 0, local=decode, local_max_tokens=512)
    assert not long.local
    cached = plan_prefill("cache_aware", remote_busy, {"decode-0": 1600}, 2000, 0.01, COST, 0, local=decode,
                          local_max_tokens=512)
    assert cached.local  # 400 uncached tokens there
    short = plan_prefill("cache_aware", remote_busy, {}, 512, 0.01, COST, 0, local=decode, local_max_tokens=512)
    assert short.local


def test_past_the_overflow_time_a_decode_worker_takes_a_long_prompt():
    """Overflow: when even the best prefill worker is predicted past `local_overflow_s`, the bound on a
    local prompt's length is lifted and the local plan wins whenever it is predicted faster at all (the
    decode worker computes it a capped chunk a step). Below it, or with local prefill bounded to 0, nothing
    changes."""
    decode = WorkerView("decode-0", "decode", 1000, 1000, queued_prefill_tokens=1500)
    kwargs = dict(local=decode, local_max_tokens=512, local_penalty=1.0)
    busy = views(queue_a=2000, queue_b=2000)  # 4.01 s to a first token there, 3.5 s locally
    overflow = plan_prefill("cache_aware", busy, {}, 2000, 0.01, COST, 0, local_overflow_s=1.0, **kwargs)
    assert overflow.local and overflow.predicted_ttft_s == pytest.approx(3500 * COST)
    assert not plan_prefill("cache_aware", busy, {}, 2000, 0.01, COST, 0, local_overflow_s=5.0, **kwargs).local
    assert not plan_prefill("cache_aware", busy, {}, 2000, 0.01, COST, 0, local_overflow_s=None, **kwargs).local
    never = dict(kwargs, local_max_tokens=0)
    assert not plan_prefill("cache_aware", busy, {}, 2000, 0.01, COST, 0, local_overflow_s=1.0, **never).local
    slower = WorkerView("decode-0", "decode", 1000, 1000, queued_prefill_tokens=3000)
    assert not plan_prefill("cache_aware", busy, {}, 2000, 0.01, COST, 0, local=slower, local_max_tokens=512,
                            local_overflow_s=1.0).local


def test_overflow_is_for_one_tenant_seen_within_the_window():
    recent = RecentTenants(window_s=60.0)
    recent.saw("a", 0.0)
    assert recent.alone("a", 1.0) and recent.alone(ANY_TENANT, 1.0)
    recent.saw("b", 10.0)
    assert not recent.alone("a", 11.0) and not recent.alone("b", 11.0)
    assert not recent.at_most_one(11.0) and recent.at_most_one(71.0)
    assert recent.alone("a", 71.0), "b was last seen more than a window ago"
    recent.saw(None, 80.0)  # anonymous requests are a tenant of their own
    assert not recent.alone("a", 81.0)


def test_round_robin_and_least_loaded():
    assert [plan_prefill("round_robin", views(), {}, 10, 0, COST, t).worker_id for t in range(3)] == [
        "prefill-a", "prefill-b", "prefill-a"]
    assert plan_prefill("least_loaded", views(queue_a=50), {}, 10, 0, COST, 0).worker_id == "prefill-b"
    with pytest.raises(ValueError, match="unknown routing policy"):
        plan_prefill("fastest", views(), {}, 10, 0, COST, 0)


def test_pick_decode_needs_room():
    d = [WorkerView("d0", "decode", 10, 100), WorkerView("d1", "decode", 50, 100)]
    assert pick_decode(d, 20).worker_id == "d1"
    assert pick_decode(d, 60) is None


def _run(client, submitted, params):
    return list(client.events(submitted))


def test_live_cluster_routes_to_the_cached_worker_then_around_its_queue(ray_session):
    config = load("disagg-2p2d.yaml")
    config = config.model_copy(update={
        "decode": config.decode.model_copy(update={"replicas": 1}),
        "scheduler": config.scheduler.model_copy(update={"local_prefill": False}),
    })
    cluster = Cluster.start(config)
    try:
        client = open_client(cluster)
        g = torch.Generator().manual_seed(5)
        prefix = torch.randint(10, 2048, (256,), generator=g).tolist()
        params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)

        first = client.submit(prefix + [11, 12], params)
        _run(client, first, params)
        owner = first.route.prefill
        wait_until_reported(cluster)  # the owner's KV events reach the scheduler with its next report

        # Both prefill workers idle: the one holding the 256-token prefix wins.
        again = client.submit(prefix + [13, 14, 15], params)
        _run(client, again, params)
        assert again.route.prefill == owner
        assert again.route.cached_tokens == 256
        wait_until_reported(cluster)  # the owner's queue as it reports it: empty again

        # A burst of long requests on that prefix: the owner's queue grows until the other worker,
        # with nothing cached, is predicted faster.
        burst = [client.submit(prefix + torch.randint(10, 2048, (1000,), generator=g).tolist(), params) for _ in range(6)]
        routes = [s.route.prefill for s in burst]
        for s in burst:
            _run(client, s, params)
        assert routes[0] == owner
        assert any(r != owner for r in routes[1:]), routes
        wait_until_idle(cluster)
    finally:
        cluster.shutdown()
