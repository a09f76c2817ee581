"""Operator endpoints on the ingress port, kept out of the OpenAPI schema: `POST /admin/scale`, and
`GET /admin/steps` (every worker's recent engine steps, timed end to end, for `tandem plan profile
--from-server` to fit the cost model on).

Who may call them is checked by the body guard (body_guard.py) with `AdminAccess.check`, from the headers
and the peer before any byte of the body is read; the body then has the same size limit as any other.
Guarded by `ingress.admin_key` (a bearer token) when set. Without one, only clients on this machine
(loopback) may call them, and only when the ingress itself binds loopback: bound to a routable address,
a same-host proxy would make every client look local. The client is the TCP peer; X-Forwarded-For
counts only from `ingress.trusted_proxies` (the server is built that way).
"""

from __future__ import annotations

import asyncio
import hmac

from dataclasses import dataclass

from fastapi import FastAPI, Request
from pydantic import BaseModel, ConfigDict, Field

from actors.worker.step_log import FIELDS as STEP_FIELDS
from cluster.control.launch import Cluster, role_of
from cluster.control.scaling import ResizeInProgress, scale
from cluster.frontend.http.body_guard import admitted_admin
from cluster.frontend.http.protocol import ApiError

LOOPBACK = {"127.0.0.1", "::1", "localhost"}
STEPS_TIMEOUT_S = 30.0


class ScaleRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    prefill: int | None = Field(None, ge=0)
    decode: int | None = Field(None, ge=1)
    colocated: int | None = Field(None, ge=1)


@dataclass(frozen=True)
class AdminAccess:
    admin_key: str | None
    bind_host: str

    def check(self, authorization: str | None, client: str | None) -> None:
        """Raises the 401/403 to answer; `client`: the peer's address (a trusted proxy's forwarded one)."""
        if self.admin_key is None:
            if self.bind_host not in LOOPBACK:
                raise ApiError(403, "admin endpoints need ingress.admin_key on an ingress that does not bind loopback",
                               None, "permission_error")
            if client is None or client not in LOOPBACK:
                raise ApiError(403, "admin endpoints answer only local clients unless ingress.admin_key is set", None,
                               "permission_error")
            return
        sent = (authorization or "").removeprefix("Bearer ").strip()
        if not hmac.compare_digest(sent.encode(), self.admin_key.encode()):
            raise ApiError(401, "a valid admin key is required", None, "authentication_error")


def add_admin_routes(app: FastAPI, cluster: Cluster) -> None:
    """The routes only: the app's body guard must have been given an `AdminAccess` (create_app's `admin`)."""
    @app.post("/admin/scale", include_in_schema=False)
    async def admin_scale(body: ScaleRequest, request: Request):
        admitted_admin(request)
        replicas = {role: n for role, n in body.model_dump().items() if n is not None}
        if not replicas:
            raise ApiError(400, "give at least one of prefill, decode, colocated", None)
        try:
            return await asyncio.to_thread(scale, cluster, replicas)
        except ResizeInProgress as exc:
            raise ApiError(409, str(exc), None, "conflict") from None
        except ValueError as exc:
            raise ApiError(400, str(exc), None) from None

    @app.get("/admin/steps", include_in_schema=False)
    async def admin_steps(request: Request):
        admitted_admin(request)
        workers = dict(cluster.workers)  # a resize may change it while we wait
        answers = await asyncio.gather(*(_steps_of(handle) for handle in workers.values()))
        return {"fields": list(STEP_FIELDS),
                "workers": [{"worker_id": wid, "role": role_of(wid), **answer}
                            for wid, answer in zip(workers, answers)]}


async def _steps_of(handle) -> dict:
    try:
        total, steps = await asyncio.wait_for(handle.step_log.remote(), STEPS_TIMEOUT_S)
    except Exception as exc:  # a worker gone or stuck is reported, the others still answer
        return {"error": f"{type(exc).__name__}: {exc}"[:300]}
    return {"steps_total": total, "steps": [list(step) for step in steps]}
