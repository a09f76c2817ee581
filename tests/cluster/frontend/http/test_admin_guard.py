"""Exposure of the HTTP front. An ingress bound to a routable address refuses to start without API keys
unless told to serve anonymously, and then reports no prefix-cache hits. Who may resize the pools:
only holders of the admin key (the configured one, or the one the ingress generates), wherever they
connect from, and no request may ask for more than the pool's `max_replicas`. Nothing here resizes
anything: every call is refused or fails validation, and the pools stay as they were."""

from __future__ import annotations

from contextlib import contextmanager

import httpx
import openai
import pytest

from cluster.control.config import TenantSection
from cluster.control.lifecycle.launch import Cluster
from cluster.frontend.admin_key import read_generated_key
from cluster.frontend.http.server import make_server
from tests.helpers.cluster import load
from tests.cluster.frontend.http.test_body_guard import _chunked_post, _rss
from tests.helpers.http_server import MODEL, running


@pytest.fixture(scope="module")
def cluster(ray_session):
    live = Cluster.start(load("local.yaml"))
    yield live
    live.shutdown()


@contextmanager
def ingress(cluster: Cluster, host: str, **settings):
    """The HTTP server in front of `cluster`, bound to `host`, with `settings` in its ingress config."""
    original = cluster.config
    cluster.config = original.model_copy(update={"ingress": original.ingress.model_copy(update=settings)})
    try:
        http = make_server(cluster, host, 0)
    finally:
        cluster.config = original
    with running(http) as url:
        yield url


def _scale(url: str, body: dict, **headers) -> httpx.Response:
    return httpx.post(url + "/admin/scale", json=body, headers=headers, timeout=30)


def test_no_client_address_stands_for_the_admin_key(cluster):
    """Loopback (or a forwarded address) once let a keyless call through; now only the key counts."""
    spoofed = {"X-Forwarded-For": "127.0.0.1"}
    with ingress(cluster, "127.0.0.1", trusted_proxies=["127.0.0.1"]) as url:
        assert _scale(url, {"decode": 2}, **spoofed).status_code == 401
        too_many = _scale(url, {"decode": 1000}, Authorization=f"Bearer {read_generated_key()}")
        assert too_many.status_code == 400, too_many.text  # let through with the key, stopped by the cap
        assert "at most 64" in too_many.json()["error"]["message"]
    assert sorted(cluster.workers) == ["decode-0", "prefill-0"]


def test_a_routable_ingress_needs_keys(cluster, tmp_path):
    with pytest.raises(ValueError, match="refusing to serve on 0.0.0.0 with no API keys"):
        with ingress(cluster, "0.0.0.0"):
            pass
    # Reached over loopback here, but bound to every interface.
    with ingress(cluster, "0.0.0.0", allow_anonymous=True) as url:
        refused = _scale(url, {"decode": 2})
        assert refused.status_code == 401 and "admin key" in refused.json()["error"]["message"]
        # Everyone shares one prefix cache here: a hit reported to one user would reveal another's prompt.
        body = {"model": MODEL, "prompt": "a shared system prompt " * 8, "max_tokens": 2, "temperature": 0}
        usages = [httpx.post(url + "/v1/completions", json=body, timeout=120).json()["usage"] for _ in range(2)]
        assert [u["prompt_tokens_details"]["cached_tokens"] for u in usages] == [0, 0]
    with ingress(cluster, "127.0.0.1") as url:  # the same cache, now warm, reported on a loopback ingress
        usage = httpx.post(url + "/v1/completions", json=body, timeout=120).json()["usage"]
        assert usage["prompt_tokens_details"]["cached_tokens"] > 0
    key_file = tmp_path / "admin-key"
    key_file.write_text("s3cret\n")
    with ingress(cluster, "0.0.0.0", allow_anonymous=True, admin_key_file=str(key_file)) as url:
        assert _scale(url, {"decode": 2}).status_code == 401
        wrong = _scale(url, {"decode": 2}, Authorization="Bearer nope")
        assert wrong.status_code == 401 and "s3cret" not in wrong.text
        capped = _scale(url, {"prefill": 65}, Authorization="Bearer s3cret")
        assert capped.status_code == 400 and "max_replicas" in capped.json()["error"]["message"]
    assert sorted(cluster.workers) == ["decode-0", "prefill-0"]


class BodyCounter:
    """Outermost ASGI layer of the test's server: counts the body bytes uvicorn handed to the app."""

    def __init__(self, app):
        self.app, self.received = app, 0

    async def __call__(self, scope, receive, send):
        async def counted():
            message = await receive()
            self.received += len(message.get("body", b""))
            return message
        await self.app(scope, counted, send)


def test_admin_scale_refuses_a_huge_body_without_a_key_before_reading_it(cluster):
    """The attack: 1.5 GB chunked into /admin/scale without a key took the ingress 713 MB -> 6.67 GB and got
    a 400. 200 MB here: a 401 once the head is read, the body never reaches the app."""
    original = cluster.config
    cluster.config = original.model_copy(update={"ingress": original.ingress.model_copy(update={"admin_key": "s3cret"})})
    try:
        http = make_server(cluster, "127.0.0.1", 0)
    finally:
        cluster.config = original
    counter = BodyCounter(http.config.app)
    http.config.app = counter
    with running(http) as url:
        port = int(url.rsplit(":", 1)[1])
        before = _rss()
        status, body, sent = _chunked_post(port, None, 200 << 20, "/admin/scale")
        grown = _rss() - before
    assert (status, body["error"]["type"]) == (401, "authentication_error"), body
    assert counter.received == 0
    assert sent < 64 << 20  # what the client got into the sockets' buffers before the answer
    assert grown < 64 << 20  # the server (a thread of this process) kept none of it
    assert sorted(cluster.workers) == ["decode-0", "prefill-0"]


def test_metrics_show_no_tenant_unless_configured(cluster):
    """/metrics has no authentication: by default it names no tenant and none of their load (it showed
    every tenant's name and live KV blocks); `metrics_tenant_labels: true` exports them."""
    keys = {"key-a": TenantSection(tenant="tenant-alpha"), "key-b": TenantSection(tenant="tenant-beta")}
    for labels in (False, True):
        with ingress(cluster, "127.0.0.1", api_keys=keys, metrics_tenant_labels=labels) as url:
            a = openai.OpenAI(base_url=url + "/v1", api_key="key-a", max_retries=0)
            held = a.completions.create(model=MODEL, prompt="hold some KV", max_tokens=400, stream=True,
                                        extra_body={"ignore_eos": True})
            next(iter(held))
            metrics = httpx.get(url + "/metrics", timeout=30)
            held.close()
        assert metrics.status_code == 200
        assert ("tenant-alpha" in metrics.text, "tandem:tenant_kv_blocks" in metrics.text) == (labels, labels)
        assert "tenant-beta" not in metrics.text or labels
