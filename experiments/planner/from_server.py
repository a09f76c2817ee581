"""`tandem plan profile --from-server URL`: the cost model fitted on a running cluster's own steps.

An in-process profile times `Engine.step` alone, with the machine to itself. A worker in a cluster also
sends its tokens out, takes commands and reports between steps, and shares the machine with the others;
`GET /admin/steps` gives each worker's recent steps timed end to end (start to the next start), and the
fit on those is what the planner should predict that deployment with. Send the server traffic like the
traffic to plan for first: the fit sees only the shapes the workers ran.
"""

from __future__ import annotations

import httpx

from actors.worker.step_log import FIELDS, StepRecord
from cluster.control.autoscale.fit import refit
from cluster.control.autoscale.profile import EngineProfile
from cluster.frontend.admin_key import read_generated_key


def fetch_steps(url: str, admin_key: str | None = None, role: str | None = None,
                timeout_s: float = 60.0) -> list[StepRecord]:
    """Every worker's logged steps (of `role` only, if given). `admin_key`: the server's; None: the key a local
    server with no ingress.admin_key generated (cluster/frontend/admin_key.py)."""
    admin_key = admin_key or read_generated_key()
    headers = {"Authorization": f"Bearer {admin_key}"} if admin_key else {}
    r = httpx.get(url.rstrip("/") + "/admin/steps", headers=headers, timeout=timeout_s)
    if r.status_code != 200:
        raise RuntimeError(f"{url}/admin/steps answered {r.status_code}: {r.text[:300]}")
    body = r.json()
    if body["fields"] != list(FIELDS):
        raise RuntimeError(f"{url}/admin/steps sends fields {body['fields']}, this tandem reads {list(FIELDS)}")
    steps = []
    for worker in body["workers"]:
        if "error" in worker:
            raise RuntimeError(f"worker {worker['worker_id']} did not give its steps: {worker['error']}")
        if role is None or worker["role"] == role:
            steps += [StepRecord(*step) for step in worker["steps"]]
    return steps


def profile_from_server(url: str, base: EngineProfile, admin_key: str | None = None, role: str | None = None,
                        seconds: str = "period_s") -> EngineProfile:
    steps = fetch_steps(url, admin_key, role)
    return refit(base, steps, url + (f" ({role} workers)" if role else ""), seconds)
