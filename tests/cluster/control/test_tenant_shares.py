"""Tenant shares of the admission queue and the gate's token refunds: the bookkeeping, on real owners."""

from __future__ import annotations

from actors.protocol.messages import GenerateRequest
from actors.protocol.sampling_params import SamplingParams
from cluster.control.config import TenantSection
from cluster.control.scheduler.registry import WorkerRegistry
from cluster.control.scheduler.request_table import RequestTable
from cluster.control.scheduler.tenant_shares import TenantShares
from cluster.frontend.http.gate import Gate, tenant_limits


def _request(tenant: str | None, share: float | None) -> GenerateRequest:
    return GenerateRequest(f"{tenant}-r", (1, 2, 3), SamplingParams(max_tokens=4), "tcp://127.0.0.1:9", tenant, share)


def test_a_tenant_fills_only_its_share_of_the_queue():
    shares = TenantShares(RequestTable(), WorkerRegistry(10.0, 60.0, lambda *_: None), max_queued=4)
    a, b, anonymous = _request("a", 0.5), _request("b", 0.5), _request(None, None)
    assert shares.enter_queue(a) is None and shares.enter_queue(a) is None
    refused = shares.enter_queue(a)  # a third: tenant a would hold more than half the queue
    assert refused is not None and refused.retry_after_s == 1.0 and "'a' has 2 requests waiting" in refused.reason
    migrated = a.continued((7, 8))  # a running stream moved off a lost worker: never refused
    assert shares.enter_queue(migrated) is None
    shares.leave_queue(migrated)
    assert shares.enter_queue(b) is None and shares.enter_queue(anonymous) is None
    assert shares.queued() == 4
    shares.leave_queue(a)
    assert shares.enter_queue(a) is None
    for r in (a, a, b, anonymous):
        shares.leave_queue(r)
    shares.check_integrity()
    assert shares.queued() == 0
    assert shares.kv_limit(a, "decode") is None  # no worker registered: no pool to take a share of


def test_equal_shares_and_default_token_rates_from_config():
    sections = {"k1": TenantSection(tenant="a"), "k2": TenantSection(tenant="a"),
                "k3": TenantSection(tenant="b", kv_share=0.25, tokens_per_minute=60)}
    limits = tenant_limits(sections, default_tokens_per_minute=1000)
    assert limits["k1"].kv_share == 0.5 and limits["k2"].kv_share == 0.5  # two tenants, whatever the keys
    assert limits["k3"].kv_share == 0.25 and limits["k3"].tokens_per_minute == 60
    assert limits["k1"].tokens_per_minute == 1000
    alone = tenant_limits({"k": TenantSection(tenant="solo")}, None)["k"]
    assert alone.kv_share is None and alone.tokens_per_minute is None  # a lone tenant has the whole pool


def test_tokens_not_generated_are_given_back():
    gate = Gate(tenant_limits({"k": TenantSection(tenant="a", tokens_per_minute=600)}, None))
    gate.admit("a", 500)  # prompt + max_tokens x n, charged up front
    gate.release("a", unused_tokens=400)  # it stopped early: 400 of them never generated
    gate.admit("a", 450)  # 100 charged + 450 fits in 600 only because of the refund
    assert gate.in_flight("a") == 1
