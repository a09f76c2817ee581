"""The ingress gate: API keys -> tenants (401), per-tenant limits (429 + Retry-After), cache isolation."""

from __future__ import annotations

import time

import httpx
import openai
import pytest
import ray
import uvicorn

from cluster.frontend.open_client import open_client
from cluster.frontend.http.app import create_app
from cluster.frontend.http.ingress import Ingress
from cluster.frontend.http.served_model import ServedModel
from cluster.frontend.http.gate import Gate, TenantLimits
from cluster.frontend.http.protocol import ApiError
from tests.helpers.cluster import wait_until_idle, wait_until_reported
from tests.helpers.http_server import MODEL, running



def _ingress(client, gate: Gate, **kwargs) -> Ingress:
    return Ingress(client, ServedModel(MODEL, client.tokenizer, 2048, 2048), gate, **kwargs)

def test_gate_unit_limits():
    gate = Gate({"ka": TenantLimits("a", requests_per_minute=2, max_concurrency=1),
                 "kb": TenantLimits("b", tokens_per_minute=600)})
    assert gate.authenticate("Bearer ka") == "a"
    for header in (None, "Bearer nope", "ka", "Basic ka"):
        with pytest.raises(ApiError) as err:
            gate.authenticate(header)
        assert err.value.status == 401
    gate.admit("a", 10)
    with pytest.raises(ApiError) as err:  # one in flight is the quota
        gate.admit("a", 10)
    assert err.value.status == 429 and "in flight" in err.value.message
    gate.release("a")
    gate.admit("a", 10)
    gate.release("a")
    with pytest.raises(ApiError) as err:  # the third request within a minute
        gate.admit("a", 10)
    assert err.value.status == 429 and 1 <= int(err.value.headers["Retry-After"]) <= 31
    gate.admit("b", 500)
    with pytest.raises(ApiError) as err:  # 600 tokens a minute: 200 more must wait ~10 s
        gate.admit("b", 200)
    assert 10 <= int(err.value.headers["Retry-After"]) <= 12
    assert gate.in_flight("a") == 0 and gate.in_flight("b") == 1
    assert Gate(None).authenticate(None) is None  # no keys: no authentication


@pytest.fixture(scope="module")
def gated(server):  # noqa: F811
    cluster = server[0]
    gate = Gate({"key-a": TenantLimits("tenant-a"), "key-b": TenantLimits("tenant-b", requests_per_minute=3)})
    ingress = _ingress(open_client(cluster), gate)
    http = uvicorn.Server(uvicorn.Config(create_app(ingress, cluster.scheduler), host="127.0.0.1", port=0,
                                         log_level="warning"))
    with running(http) as url:
        yield url + "/v1"


def test_keys_tenants_and_cache_isolation(server, gated):  # noqa: F811
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=gated, api_key="wrong", max_retries=0).completions.create(model=MODEL, prompt="x")
    a = openai.OpenAI(base_url=gated, api_key="key-a", max_retries=0)
    b = openai.OpenAI(base_url=gated, api_key="key-b", max_retries=0)
    prompt = "A long shared system prompt that fills several KV blocks of sixteen tokens each, " * 3
    first = a.completions.create(model=MODEL, prompt=prompt, max_tokens=2, user="tenant-b")
    wait_until_reported(server[0])  # its KV events reach the scheduler
    again = a.completions.create(model=MODEL, prompt=prompt, max_tokens=2)
    other = b.completions.create(model=MODEL, prompt=prompt, max_tokens=2, user="tenant-a")  # `user` is no salt
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert again.usage.prompt_tokens_details.cached_tokens > 0
    assert other.usage.prompt_tokens_details.cached_tokens == 0
    b.completions.create(model=MODEL, prompt="x", max_tokens=1)
    b.completions.create(model=MODEL, prompt="x", max_tokens=1)
    limited = httpx.post(gated + "/completions", headers={"Authorization": "Bearer key-b"},
                         json={"model": MODEL, "prompt": "x", "max_tokens": 1})
    assert limited.status_code == 429 and int(limited.headers["retry-after"]) >= 1
    assert limited.json()["error"]["type"] == "rate_limit_error"


def test_no_ready_worker_is_503(ray_session):
    """A scheduler with no worker registered: the ingress answers 503 with Retry-After, not 5xx noise."""
    import ray

    from cluster.control.scheduler.actor import Scheduler, SchedulerSettings

    settings = SchedulerSettings(mode="disaggregated", routing="cache_aware", block_size=16, model_id="m",
                                 reserve="prompt_plus_max_tokens", max_queued=8, queue_timeout_s=1.0,
                                 local_prefill=True, local_prefill_penalty=1.0, prefill_s_per_token=1e-4,
                                 transfer_bytes_per_s=1e9)
    scheduler = ray.remote(Scheduler).options(num_cpus=0).remote(settings)
    from actors.engine.text.tokenizer import load_tokenizer
    from cluster.frontend.client import TandemClient

    client = TandemClient(scheduler, load_tokenizer())
    http = uvicorn.Server(uvicorn.Config(create_app(_ingress(client, Gate(None)), scheduler),
                                         host="127.0.0.1", port=0, log_level="warning"))
    try:
        with running(http) as base:
            answer = httpx.post(base + "/v1/completions", json={"model": MODEL, "prompt": "x"}, timeout=30)
            assert answer.status_code == 503 and int(answer.headers["retry-after"]) >= 1, answer.text
            assert httpx.get(base + "/ready").status_code == 503
    finally:
        client.close()
        ray.kill(scheduler)


def test_a_tenant_cannot_hold_more_than_its_share_of_the_kv(server):
    """Two tenants with half the decode KV each (512 blocks of 16 tokens): one tenant's long request holds
    most of its half; its next request is refused (429), the other tenant still gets a request as big."""
    cluster = server[0]
    gate = Gate({"key-a": TenantLimits("tenant-a", kv_share=0.5), "key-b": TenantLimits("tenant-b", kv_share=0.5)})
    with running(uvicorn.Server(uvicorn.Config(create_app(_ingress(open_client(cluster), gate, tenant_metrics=True),
                                                          cluster.scheduler),
                                               host="127.0.0.1", port=0, log_level="warning"))) as url:
        a = openai.OpenAI(base_url=url + "/v1", api_key="key-a", max_retries=0)
        b = openai.OpenAI(base_url=url + "/v1", api_key="key-b", max_retries=0)
        big = dict(model=MODEL, prompt="hold the pool", n=2, max_tokens=1900, extra_body={"ignore_eos": True})
        with pytest.raises(openai.BadRequestError) as too_big:  # 4 x 1100 tokens: more than the whole share
            a.completions.create(model=MODEL, prompt="x", n=4, max_tokens=1100)
        assert "share" in too_big.value.message and too_big.value.body["param"] == "max_tokens"
        held = a.completions.create(stream=True, **big)  # 2 x 1900 + prompt: ~238 of tenant-a's 256 blocks
        next(iter(held))
        started = time.monotonic()
        with pytest.raises(openai.RateLimitError) as refused:
            a.completions.create(model=MODEL, prompt="one more", max_tokens=400)
        assert "tenant-a" in refused.value.message and "share" in refused.value.message
        assert int(refused.value.response.headers["retry-after"]) >= 1
        assert time.monotonic() - started < 30  # the admission deadline (1 s here), not the request's timeout
        other = b.completions.create(stream=True, **big)  # tenant-b's half is untouched
        next(iter(other))
        state = ray.get(cluster.scheduler.state.remote(), timeout=30)
        assert set(state.tenant_blocks) == {"tenant-a", "tenant-b"}, state.tenant_blocks
        assert 230 < state.tenant_blocks["tenant-a"] == state.tenant_blocks["tenant-b"] <= 256, state.tenant_blocks
        assert b.completions.create(model=MODEL, prompt="x", max_tokens=1).choices[0].finish_reason == "length"
        metrics = httpx.get(url + "/metrics", timeout=30).text
        assert f'tandem:tenant_kv_blocks{{tenant="tenant-a"}} {float(state.tenant_blocks["tenant-a"])}' in metrics
        held.close()
        other.close()
    idle = wait_until_idle(cluster)
    assert idle["scheduler"]["tenant_blocks"] == {} and idle["scheduler"]["in_flight"] == 0
