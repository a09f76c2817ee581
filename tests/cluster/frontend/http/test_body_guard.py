"""The body guard under a real uvicorn server and raw sockets: a chunked body without a key (the API's,
or the admin key on /admin/*) gets 401 before it is read, an oversized chunked body gets 413 at the
limit on every route (the open probes too), a body trickled slower than the body timeout gets 408 at it
(3 s here; the shipped value in the slow tier), and
a body within the limit reaches the app whole, with the tenant the guard authenticated it as (the routes
authenticate no more). The app behind the guard only records what reached it."""

from __future__ import annotations

import json
import socket
import threading
import time
from contextlib import contextmanager

import psutil
import pytest
import uvicorn

from cluster.control.config import IngressSection
from cluster.frontend.http.admin import AdminAccess
from cluster.frontend.http.body_guard import BodyGuard
from cluster.frontend.http.gate import Gate, TenantLimits

LIMIT = 1 << 20
BODY_TIMEOUT_S = 3.0
CHUNK = b"x" * 65536


class Recorder:
    """The app behind the guard: answers 200 with the number of body bytes it received and its tenant."""

    def __init__(self):
        self.calls = 0

    async def __call__(self, scope, receive, send):
        self.calls += 1
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        payload = json.dumps({"received": len(body), "tenant": scope.get("state", {}).get("tenant")}).encode()
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(payload))]})
        await send({"type": "http.response.body", "body": payload})


@contextmanager
def _guarded_server(**guard):
    """A uvicorn server of the Recorder behind the guard: (app, port)."""
    app = Recorder()
    guarded = BodyGuard(app, Gate({"k1": TenantLimits("a")}), LIMIT, AdminAccess("adm", "127.0.0.1").check, **guard)
    http = uvicorn.Server(uvicorn.Config(guarded, host="127.0.0.1", port=0, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=http.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not http.started:
        assert time.monotonic() < deadline, "the server did not start within 30 s"
        time.sleep(0.05)
    try:
        yield app, http.servers[0].sockets[0].getsockname()[1]
    finally:
        http.should_exit = True
        thread.join(timeout=10)
        assert not thread.is_alive(), "the server did not stop within 10 s"


@pytest.fixture(scope="module")
def server():
    """The guard with a 3 s body timeout, so that the fast tier's trickle test ends soon."""
    with _guarded_server(body_timeout_s=BODY_TIMEOUT_S) as live:
        yield live


@pytest.fixture(scope="module")
def shipped_server():
    """The guard as the product builds it: the body timeout left at the config's default."""
    with _guarded_server() as live:
        yield live


def _chunked_post(port: int, key: str | None, total: int, path: str = "/v1/completions") -> tuple[int, dict, int]:
    """POST `total` bytes chunked, stopping as soon as a response arrives; (status, body, bytes sent). A
    thread reads the answer while this one sends whole chunks (a partial send would break the framing)."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=60)
    auth = f"Authorization: Bearer {key}\r\n" if key else ""
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\n{auth}Content-Type: application/json\r\n"
                 "Transfer-Encoding: chunked\r\n\r\n".encode())
    parts: list[bytes] = []
    answered = threading.Event()

    def read() -> None:
        try:
            while part := sock.recv(65536):
                parts.append(part)
                answered.set()
        except OSError:
            pass
        answered.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    sent = 0
    try:
        while sent < total and not answered.is_set():
            n = min(len(CHUNK), total - sent)
            sock.sendall(b"%x\r\n" % n + CHUNK[:n] + b"\r\n")
            sent += n
        if sent >= total:
            sock.sendall(b"0\r\n\r\n")
    except OSError:  # the server closed the connection after answering
        pass
    reader.join(timeout=60)
    sock.close()
    head, _, body = b"".join(parts).partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    if b"transfer-encoding: chunked" in head.lower():
        body = body.split(b"\r\n", 1)[1].rsplit(b"\r\n0\r\n", 1)[0]
    return status, json.loads(body), sent


def _rss() -> int:
    return psutil.Process().memory_info().rss


@pytest.mark.parametrize("path", ["/v1/completions", "/tokenize", "/detokenize", "/tokenizer_info", "/admin/scale"])
def test_no_key_gets_401_before_the_body_is_read(server, path):
    app, port = server
    before = _rss()
    status, body, sent = _chunked_post(port, None, 1536 << 20, path)  # a 1.5 GB body, if anyone read it
    assert status == 401 and body["error"]["type"] == "authentication_error"
    assert sent < 64 << 20  # the answer came long before the body would have been sent
    assert app.calls == 0
    assert _rss() - before < 128 << 20  # the server (a thread of this process) kept none of it


@pytest.mark.parametrize("path", ["/v1/completions", "/health", "/metrics", "/admin/scale"])
def test_an_oversized_chunked_body_gets_413_at_the_limit(server, path):
    """Every route has the same limit: a probe that reads no body is no way around it."""
    app, port = server
    before = _rss()
    status, body, sent = _chunked_post(port, "adm" if path.startswith("/admin/") else "k1", 50 << 20, path)
    assert status == 413 and body["error"]["code"] == 413
    assert sent < 50 << 20
    assert app.calls == 0
    assert _rss() - before < 128 << 20


def test_a_body_within_the_limit_reaches_the_app_whole(server):
    app, port = server
    status, body, sent = _chunked_post(port, "k1", LIMIT)
    assert (status, body, sent) == (200, {"received": LIMIT, "tenant": "a"}, LIMIT)
    assert app.calls == 1


def _trickle(port: int, limit_s: float) -> tuple[bytes, float]:
    """Sends a body a byte a second until the server answers or closes; (its answer, seconds it took)."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=60)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer k1\r\n"
                 b"Content-Length: 1000\r\n\r\n")
    started, answer = time.monotonic(), b""
    sock.settimeout(1.0)
    while time.monotonic() - started < limit_s:
        try:
            sock.sendall(b"{")
            part = sock.recv(65536)
        except socket.timeout:
            continue
        except OSError:
            break
        if not part:
            break
        answer += part
    sock.close()
    return answer, time.monotonic() - started


def _assert_408_at(answer: bytes, seconds: float, body_timeout_s: float) -> None:
    assert answer.startswith(b"HTTP/1.1 408 "), answer
    assert json.loads(answer.partition(b"\r\n\r\n")[2])["error"]["type"] == "timeout"
    # Not before the deadline; after it by at most the 1 s read timeout plus a busy box's delay.
    assert body_timeout_s <= seconds < body_timeout_s + 10, seconds


def test_a_trickled_body_gets_408_at_the_body_timeout(server):
    """A client that sends its body a byte a second holds a connection and a task: cut at the deadline."""
    app, port = server
    calls = app.calls
    answer, seconds = _trickle(port, BODY_TIMEOUT_S + 30)
    _assert_408_at(answer, seconds, BODY_TIMEOUT_S)
    assert app.calls == calls


@pytest.mark.slow  # the shipped body timeout: half a minute of trickling
def test_a_trickled_body_gets_408_at_the_shipped_body_timeout(shipped_server):
    app, port = shipped_server
    shipped = IngressSection().body_timeout_s
    answer, seconds = _trickle(port, shipped + 30)
    _assert_408_at(answer, seconds, shipped)
    assert app.calls == 0
