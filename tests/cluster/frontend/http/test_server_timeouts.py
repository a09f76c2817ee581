"""Connections that hold the ingress without making a request, against the module's live server with the
shipped ingress defaults (header_timeout_s 10, max_connections_per_client 1024). Slowloris: sockets that
send a request head a byte every two seconds (some on /admin/scale, without a key) and sockets that send
nothing are all closed by the server within the header timeout (asserted with a 30 s margin), while a
normal completion from another address is served meanwhile. One address past the connection cap gets
503 on its extra connections, and another address is served. The attackers come from other loopback
addresses (127.0.0.2, ...) than the normal client (127.0.0.1): the cap counts per address."""

from __future__ import annotations

import socket
import time

import openai
import pytest

from cluster.control.config import IngressSection
from tests.helpers.http_server import MODEL

HEADER_TIMEOUT_S = IngressSection().header_timeout_s
CAP = IngressSection().max_connections_per_client
HEADS = {"/v1/completions": b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n",
         "/admin/scale": b"POST /admin/scale HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"}


def _open(port: int, source: str) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=10, source_address=(source, 0))
    sock.setblocking(False)
    return sock


def _closed_by_server(sock: socket.socket) -> bool:
    try:
        return sock.recv(65536) == b""
    except BlockingIOError:
        return False
    except OSError:  # reset
        return True


def _attack(port: int, slow: dict[str, int], idle: int, client: openai.OpenAI) -> tuple[dict, float | None, str]:
    """Opens the sockets, trickles head bytes into the slow ones every 2 s while a normal completion runs;
    (seconds from open to the server's close, by socket kind; seconds still open at the end; the answer)."""
    sockets = []  # (kind, socket, head still to send)
    for i, (path, n) in enumerate(slow.items()):
        sockets += [(path, _open(port, f"127.0.0.{2 + i}"), HEADS[path] + b"X-Pad: " + b"a" * 64) for _ in range(n)]
    sockets += [("idle", _open(port, "127.0.0.9"), b"") for _ in range(idle)]
    opened = time.monotonic()
    closed: dict[str, list[float]] = {}
    pending = {id(s): (kind, s, head) for kind, s, head in sockets}
    answer = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=8, temperature=0)
    next_byte = time.monotonic()
    while pending and time.monotonic() - opened < HEADER_TIMEOUT_S + 30:
        send = time.monotonic() >= next_byte
        if send:
            next_byte += 2.0
        for key, (kind, sock, head) in list(pending.items()):
            if _closed_by_server(sock):
                closed.setdefault(kind, []).append(time.monotonic() - opened)
                sock.close()
                del pending[key]
            elif send and head:
                try:
                    sock.send(head[:1])
                    pending[key] = (kind, sock, head[1:])
                except OSError:
                    pass
        time.sleep(0.2)
    for _, sock, _ in pending.values():
        sock.close()
    left = len(pending)
    return closed, (time.monotonic() - opened if left else None), f"{left} left; {answer.choices[0].text!r}"


def test_slow_and_idle_connections_are_dropped_within_the_header_timeout(server):
    url = server[1]
    port = int(url.rsplit(":", 1)[1])
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
    closed, still_open_after, note = _attack(port, {"/v1/completions": 80, "/admin/scale": 40}, idle=30, client=client)
    assert still_open_after is None, note
    assert {k: len(v) for k, v in closed.items()} == {"/v1/completions": 80, "/admin/scale": 40, "idle": 30}
    assert max(max(v) for v in closed.values()) < HEADER_TIMEOUT_S + 30
    assert client.completions.create(model=MODEL, prompt="x", max_tokens=1).choices[0].finish_reason == "length"


@pytest.mark.slow
def test_six_hundred_slow_connections(server):
    """The issue's attack at its size: 600, 100 of them on /admin/scale without a key."""
    url = server[1]
    port = int(url.rsplit(":", 1)[1])
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
    closed, still_open_after, note = _attack(port, {"/v1/completions": 400, "/admin/scale": 100}, idle=100,
                                             client=client)
    assert still_open_after is None, note
    assert sum(len(v) for v in closed.values()) == 600
    assert max(max(v) for v in closed.values()) < HEADER_TIMEOUT_S + 30


def test_one_address_past_the_connection_cap_gets_503(server):
    url = server[1]
    port = int(url.rsplit(":", 1)[1])
    held = [_open(port, "127.0.0.5") for _ in range(CAP)]
    try:
        extra = [_open(port, "127.0.0.5") for _ in range(4)]
        answers = []
        for sock in extra:
            sock.setblocking(True)
            sock.settimeout(30)
            answers.append(sock.recv(65536))
            sock.close()
        assert all(a.startswith(b"HTTP/1.1 503 ") and b"max_connections_per_client" in a for a in answers), answers
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
        assert client.completions.create(model=MODEL, prompt="x", max_tokens=1).choices[0].finish_reason == "length"
    finally:
        for sock in held:
            sock.close()
