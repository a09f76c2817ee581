"""Operator endpoints on the ingress port, kept out of the OpenAPI schema: `POST /admin/scale`, and
`GET /admin/steps` (every worker's recent engine steps, timed end to end, for `tandem plan profile
--from-server` to fit the cost model on).

Who may call them is checked by the body guard (body_guard.py) with `AdminAccess.check`, from the headers
before any byte of the body is read; the body then has the same size limit as any other. They always need
`Authorization: Bearer <key>`: `ingress.admin_key` (or `admin_key_file`), or, with neither, the key this
user's ingress generates at start in ~/.cache/tandem/admin_key (0600 in a 0700 directory; admin_key.py),
which `tandem scale` and `tandem plan profile --from-server` read. No client address counts: on loopback
every local user looks the same.
"""

from __future__ import annotations

import asyncio
import hmac
import logging

from dataclasses import dataclass

from fastapi import FastAPI, Request
from pydantic import BaseModel, ConfigDict, Field

from actors.worker.step_log import FIELDS as STEP_FIELDS
from cluster.control.lifecycle.launch import Cluster, role_of
from cluster.control.lifecycle.scaling import ResizeInProgress, scale
from cluster.frontend.admin_key import ensure_generated_key, generated_key_path
from cluster.frontend.http.body_guard import admitted_admin
from cluster.frontend.http.protocol import ApiError

LOOPBACK = {"127.0.0.1", "::1", "localhost"}
log = logging.getLogger("tandem.admin")
STEPS_TIMEOUT_S = 30.0


class ScaleRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    prefill: int | None = Field(None, ge=0)
    decode: int | None = Field(None, ge=1)
    colocated: int | None = Field(None, ge=1)


@dataclass(frozen=True)
class AdminAccess:
    """`admin_key`: the configured key; None: this user's generated one (made now if there is none).
    `bind_host`: where the ingress listens (named in the start log line)."""
    admin_key: str | None
    bind_host: str

    def __post_init__(self) -> None:
        if self.admin_key is None:
            object.__setattr__(self, "admin_key", ensure_generated_key())
            log.info("admin routes of the ingress on %s need the generated admin key in %s (no ingress.admin_key "
                     "set; tandem scale reads it there)", self.bind_host, generated_key_path())

    def check(self, authorization: str | None, client: str | None) -> None:
        """Raises the 401 to answer; `client` (the peer's address) does not count: see the module docstring."""
        scheme, _, sent = (authorization or "").strip().partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(sent.strip().encode(), self.admin_key.encode()):
            raise ApiError(401, "admin endpoints need Authorization: Bearer <admin key> (ingress.admin_key, or the "
                           "key the server generated in ~/.cache/tandem/admin_key)", None, "authentication_error")


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
