"""The ASGI layer in front of every route: who is asking, and how much they send, before a body is read.

Every HTTP request passes it. It first checks who may ask, from the headers alone: the API key for the
API (`/v1/*`, `/tokenize`, ...), the admin check for `/admin/*`, nobody for the probes (`/health`,
`/ready`, `/metrics`, `/version`) and the docs; a refusal (401/403) is sent without reading a byte of
the body. Then it counts body bytes as they arrive, chunked or not, on every route: 413 at the first
byte over `max_body_bytes` (without reading the rest), 408 when the whole body has not arrived within
`body_timeout_s` (a client trickling bytes holds a connection and a task). The body is then replayed
to the app, which goes on receiving from the client after it (a disconnect still reaches it).
"""

from __future__ import annotations

import asyncio
import json
from contextvars import ContextVar
from typing import Awaitable, Callable

from cluster.control.config import IngressSection
from cluster.frontend.http.gate import Gate
from cluster.frontend.http.protocol import ApiError

Scope = dict
Receive = Callable[[], Awaitable[dict]]
Send = Callable[[dict], Awaitable[None]]
# (Authorization header, client address) -> None, or raises the ApiError to answer (admin.AdminAccess.check)
AdminCheck = Callable[[str | None, str | None], None]

API_PREFIXES = ("/v1/", "/tokenize", "/detokenize", "/tokenizer_info")  # the routes that serve the model
ADMIN_PREFIX = "/admin/"
# The tenant the guard authenticated this request as, for code that has no `request` (a compile's slot,
# served_model.py): set in the request's own task before the route runs, so it reads the same.
current_tenant: ContextVar[str | None] = ContextVar("tenant", default=None)


class BodyGuard:
    def __init__(self, app, gate: Gate, max_body_bytes: int, admin: AdminCheck | None = None,
                 body_timeout_s: float = IngressSection().body_timeout_s):
        """`admin`: who may call `/admin/*`; None: nobody (403), e.g. an app with no admin routes."""
        self.app = app
        self.gate = gate
        self.max_body_bytes = max_body_bytes
        self.admin = admin
        self.body_timeout_s = body_timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", ())}
        try:
            # Here, once, before a byte of the body is read; the routes read what it decided from the scope.
            self._authorize(scope, headers.get("authorization"))
            length = headers.get("content-length")
            if length is not None and length.strip().isdigit() and int(length) > self.max_body_bytes:
                raise _too_large(self.max_body_bytes)
            try:
                body, more = await asyncio.wait_for(self._read(receive), self.body_timeout_s)
            except asyncio.TimeoutError:
                raise ApiError(408, f"the request body did not arrive within {self.body_timeout_s:g}s "
                                    "(ingress.body_timeout_s)", None, "timeout") from None
        except ApiError as exc:
            await _reply(send, exc)
            return
        await self.app(scope, _replay(body, more, receive), send)

    def _authorize(self, scope: Scope, authorization: str | None) -> None:
        path, state = scope["path"], scope.setdefault("state", {})
        if path.startswith(ADMIN_PREFIX):
            if self.admin is None:
                raise ApiError(403, "this server has no admin endpoints", None, "permission_error")
            client = scope.get("client")
            self.admin(authorization, client[0] if client else None)
            state["admin"] = True
        elif path.startswith(API_PREFIXES):
            state["tenant"] = self.gate.authenticate(authorization)
            current_tenant.set(state["tenant"])

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
    """The tenant the guard authenticated the request as. A route outside the API prefixes has none, and
    fails here (a 500) rather than serving an unauthenticated caller."""
    return request.state.tenant


def admitted_admin(request) -> None:
    """Fails (a 500) unless the guard passed the request's admin check: an admin route outside `/admin/`
    would otherwise answer anyone."""
    if request.state.admin is not True:
        raise RuntimeError("an admin route was reached without the guard's admin check")
