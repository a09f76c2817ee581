"""Finding 10 of issue 52: a Ray that tandem started (include_dashboard False) still ran Ray's Prometheus
exporter on 0.0.0.0 without authentication (327 KB of actor names, node memory and CPU, the session
name), and `~/.ray/auth_token` was 0644 in a 0755 directory. Now Cluster.start turns Ray's metrics
collection off unless asked (RAY_enable_metrics_collection=1) and makes the token 0600 in a 0700
directory. Ray's gRPC ports (token-authenticated) still listen on every interface: Ray has no option
to bind them to loopback.

Later, with the OTLP exporter installed (the tracing extra), the dashboard head's own Prometheus server
(44227, started though the dashboard is off) served ray_* metrics on 0.0.0.0, and the autoscaler monitor's
(44217) served autoscaler_* metrics there all along, unseen by a check that looked for "ray_" alone: any
Prometheus text on a non-loopback address now fails, and Cluster.start keeps both servers from starting
(cluster/control/lifecycle/ray_metric_ports.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # a Ray instance of its own, in a subprocess

REPO = Path(__file__).resolve().parents[3]
SCRIPT = """
import json, os, re, stat, subprocess
import httpx, psutil, ray
from cluster.control.lifecycle.launch import Cluster
from tests.helpers.cluster import load
cluster = Cluster.start(load("local.yaml"))
try:
    ours = {p.pid for p in psutil.Process().children(recursive=True)}
    node_ip = ray.util.get_node_ip_address()
    listening = []
    for line in subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True, timeout=30).stdout.splitlines():
        if {int(x) for x in re.findall(r"pid=(\\d+)", line)} & ours:
            listening.append((line.split()[3], re.findall(r'\\("([^"]+)"', line)))
    metrics = []
    for address, names in listening:
        host, port = address.rsplit(":", 1)
        if host in ("127.0.0.1", "[::1]"):
            continue
        try:
            r = httpx.get(f"http://{node_ip}:{port}/metrics", timeout=3)
            if r.status_code == 200 and ("ray_" in r.text or "# TYPE" in r.text):  # any Prometheus text
                metrics.append([address, names, len(r.text)])
        except httpx.HTTPError:
            pass  # not HTTP (gRPC), or refused
    token = os.path.expanduser("~/.ray/auth_token")
    print("REPORT", json.dumps({"listening": listening, "metrics": metrics,
                                "token": oct(stat.S_IMODE(os.stat(token).st_mode)),
                                "dir": oct(stat.S_IMODE(os.stat(os.path.dirname(token)).st_mode))}))
finally:
    cluster.shutdown()
"""


def test_a_ray_tandem_starts_serves_no_unauthenticated_metrics_and_keeps_its_token_private():
    env = {**os.environ, "PYTHONPATH": str(REPO), "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "token"}
    env.pop("RAY_enable_metrics_collection", None)
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300, cwd=REPO, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(next(x for x in done.stdout.splitlines() if x.startswith("REPORT"))[len("REPORT"):])
    assert report["listening"], report  # the check saw Ray's processes at all
    assert report["metrics"] == [], report
    assert (report["token"], report["dir"]) == ("0o600", "0o700"), report
