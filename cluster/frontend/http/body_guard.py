"""The ASGI layer in front of the API: who is asking, and how much they send, before a body is read.

For `/v1/*` requests it checks the API key from the headers first (401 without reading a byte of the
body), then counts body bytes as they arrive, chunked or not (413 at the first byte over the limit,
without reading the rest). The body, at most `max_body_bytes`, is then replayed to the app, which
goes on receiving from the client after it (a disconnect still reaches it).
"""

from __future__ import annotations

import json
from typing import Awaitable, Callable

from cluster.frontend.http.gate import Gate
from cluster.frontend.http.protocol import ApiError

Scope = dict
Receive = Callable[[], Awaitable[dict]]
Send = Callable[[dict], Awaitable[None]]


class BodyGuard:
    def __init__(self, app, gate: Gate, max_body_bytes: int,
                 prefixes: tuple[str, ...] = ("/v1/", "/tokenize", "/detokenize", "/tokenizer_info")):
        self.app = app
        self.gate = gate
        self.max_body_bytes = max_body_bytes
        self.prefixes = prefixes  # the routes that read a body or serve the model; probes stay open

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith(self.prefixes):
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", ())}
        try:
            # Here, once, before a byte of the body is read; the routes read the tenant from the scope.
            scope.setdefault("state", {})["tenant"] = self.gate.authenticate(headers.get("authorization"))
            length = headers.get("content-length")
            if length is not None and length.strip().isdigit() and int(length) > self.max_body_bytes:
                raise _too_large(self.max_body_bytes)
            body, more = await self._read(receive)
        except ApiError as exc:
            await _reply(send, exc)
            return
        await self.app(scope, _replay(body, more, receive), send)

    async def _read(self, receive: Receive) -> tuple[bytes, bool]:
        """The whole body, counted as it arrives; `more` is False when the client left mid-body."""
        chunks, total = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return b"".join(chunks), False
            chunk = message.get("body", b"")
            total += len(chunk)
            if total > self.max_body_bytes:
                raise _too_large(self.max_body_bytes)
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks), True


def _replay(body: bytes, complete: bool, receive: Receive) -> Receive:
    sent = False

    async def replayed() -> dict:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        if not complete:
            return {"type": "http.disconnect"}
        return await receive()

    return replayed


def _too_large(limit: int) -> ApiError:
    return ApiError(413, f"request body over {limit} bytes", None)


async def _reply(send: Send, error: ApiError) -> None:
    payload = json.dumps(error.body()).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode()),
               (b"connection", b"close")]
    headers += [(k.lower().encode("latin-1"), str(v).encode("latin-1")) for k, v in error.headers.items()]
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": payload})


def tenant_of(request) -> str | None:
    """The tenant the guard authenticated the request as. A route outside the guard's prefixes has none, and
    fails here (a 500) rather than serving an unauthenticated caller."""
    return request.state.tenant
