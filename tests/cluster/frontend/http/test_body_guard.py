"""The body guard under a real uvicorn server and raw sockets: a chunked body without a key gets 401
before it is read, an oversized chunked body with a key gets 413 at the limit, and a body within it
reaches the app whole, with the tenant the guard authenticated it as (the routes authenticate no more).
The app behind the guard only records what reached it."""

from __future__ import annotations

import json
import socket
import threading
import time

import psutil
import pytest
import uvicorn

from cluster.frontend.http.body_guard import BodyGuard
from cluster.frontend.http.gate import Gate, TenantLimits

LIMIT = 1 << 20
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


@pytest.fixture(scope="module")
def server():
    app = Recorder()
    guarded = BodyGuard(app, Gate({"k1": TenantLimits("a")}), LIMIT)
    http = uvicorn.Server(uvicorn.Config(guarded, host="127.0.0.1", port=0, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=http.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not http.started:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    yield app, http.servers[0].sockets[0].getsockname()[1]
    http.should_exit = True
    thread.join(timeout=10)


def _chunked_post(port: int, key: str | None, total: int, path: str = "/v1/completions") -> tuple[int, dict, int]:
    """POST `total` bytes chunked, stopping as soon as a response arrives; (status, body, bytes sent)."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    auth = f"Authorization: Bearer {key}\r\n" if key else ""
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\n{auth}Content-Type: application/json\r\n"
                 "Transfer-Encoding: chunked\r\n\r\n".encode())
    sent = 0
    sock.setblocking(False)
    response = b""
    try:
        while sent < total:
            try:
                response += sock.recv(65536)
                if response:
                    break
            except BlockingIOError:
                pass
            n = min(len(CHUNK), total - sent)
            try:
                sock.sendall(b"%x\r\n" % n + CHUNK[:n] + b"\r\n")
                sent += n
            except (BlockingIOError, BrokenPipeError, ConnectionResetError):
                time.sleep(0.01)
        if sent >= total:
            sock.sendall(b"0\r\n\r\n")
        sock.setblocking(True)
        while b"\r\n\r\n" not in response or not response.split(b"\r\n\r\n", 1)[1]:
            part = sock.recv(65536)
            if not part:
                break
            response += part
    finally:
        sock.close()
    head, _, body = response.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    return status, json.loads(body), sent


def _rss() -> int:
    return psutil.Process().memory_info().rss


@pytest.mark.parametrize("path", ["/v1/completions", "/tokenize", "/detokenize", "/tokenizer_info"])
def test_no_key_gets_401_before_the_body_is_read(server, path):
    app, port = server
    before = _rss()
    status, body, sent = _chunked_post(port, None, 1536 << 20, path)  # a 1.5 GB body, if anyone read it
    assert status == 401 and body["error"]["type"] == "authentication_error"
    assert sent < 64 << 20  # the answer came long before the body would have been sent
    assert app.calls == 0
    assert _rss() - before < 128 << 20  # the server (a thread of this process) kept none of it


def test_an_oversized_chunked_body_gets_413_at_the_limit(server):
    app, port = server
    before = _rss()
    status, body, sent = _chunked_post(port, "k1", 50 << 20)
    assert status == 413 and body["error"]["code"] == 413
    assert sent < 50 << 20
    assert app.calls == 0
    assert _rss() - before < 128 << 20


def test_a_body_within_the_limit_reaches_the_app_whole(server):
    app, port = server
    status, body, sent = _chunked_post(port, "k1", LIMIT)
    assert (status, body, sent) == (200, {"received": LIMIT, "tenant": "a"}, LIMIT)
    assert app.calls == 1
