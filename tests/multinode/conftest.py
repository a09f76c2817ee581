"""The namespaced cluster: three "hosts" on this box (experiments/netns_cluster.sh), Ray on each, and
`tandem serve` on the head. Needs root (network, PID and mount namespaces); skipped without it."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml

from cluster.control.config import TandemConfig
from tests.helpers.cluster import CONFIGS

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "experiments" / "netns_cluster.sh"
HEAD_IP = "198.51.100.10"
API_KEY = "netns-test-key"


def integrity() -> dict:
    """The cluster's integrity report, from a driver on the head (raises if an invariant is broken)."""
    return json.loads(netns("run", "head", sys.executable, "-m", "tests.multinode.integrity", timeout_s=180)
                      .strip().splitlines()[-1])


def _env() -> dict[str, str]:
    """Entering a host's mount namespace resets the working directory, so `python -m tests...` there
    finds this checkout only through PYTHONPATH (CI has no PYTHONPATH of its own)."""
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "TANDEM_NETNS_STATE": _STATE, "RAY_AUTH_MODE": "token", "PYTHONPATH": path}


def netns(*args: str, timeout_s: float = 120) -> str:
    done = subprocess.run([str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout_s, cwd=REPO,
                          env=_env())
    if done.returncode:
        raise RuntimeError(f"netns_cluster.sh {' '.join(args)} failed ({done.returncode}): {done.stderr[-2000:]}")
    return done.stdout


_STATE = "/run/tandem-netns-test"


def _can_run() -> str | None:
    if os.geteuid() != 0:
        return "needs root (network namespaces)"
    missing = [tool for tool in ("ip", "tc", "iptables", "unshare", "nsenter", "pgrep") if shutil.which(tool) is None]
    return f"missing {', '.join(missing)}" if missing else None


def serve_config(tmp: Path) -> Path:
    """configs/local.yaml spread over the hosts: the prefill worker on w1, two decode workers on w2 and
    w3 (their `tandem_prefill` / `tandem_decode` resources), KV over tcp, the ingress on the head's
    address, and a short heartbeat timeout so a silent host is routed around quickly."""
    config = TandemConfig.from_file(CONFIGS / "local.yaml").model_dump(mode="json", exclude_none=True)
    config["engine"]["num_kv_blocks"] = 512
    config["prefill"].update(resources={"tandem_prefill": 1}, num_cpus=1)
    config["decode"].update(resources={"tandem_decode": 1}, num_cpus=1, replicas=2)
    config["scheduler"].update(heartbeat_timeout_s=5.0, queue_timeout_s=2.0, local_prefill=False, lease_s=5.0)
    config["transfer"].update(zmq_transport="tcp", host="0.0.0.0")
    config["ingress"].update(host=HEAD_IP, port=8000, api_keys={API_KEY: {"tenant": "netns"}})
    path = tmp / "netns-serve.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


@pytest.fixture(scope="module")
def hosts():
    """head + w1 (prefill) + w2, w3 (decode) with Ray on each; everything removed afterwards, pass or fail."""
    why = _can_run()
    if why:
        pytest.skip(why)
    netns("down")  # what a killed earlier run left
    try:
        netns("up", "3")
        netns("ray-up", timeout_s=300)
        yield
    finally:
        netns("down")


@pytest.fixture(scope="module")
def served(hosts, tmp_path_factory, default_model_dir):
    """`tandem serve` on the head; yields its base URL (reached from this root namespace over the bridge)."""
    config = serve_config(tmp_path_factory.mktemp("netns"))
    log = config.with_suffix(".log")
    with log.open("w") as out:
        proc = subprocess.Popen([str(SCRIPT), "run", "head", "tandem", "serve", "--address", "auto",
                                 "--config", str(config)], stdout=out, stderr=subprocess.STDOUT, env=_env())
    url = f"http://{HEAD_IP}:8000"
    try:
        deadline = time.monotonic() + 300
        while True:
            assert proc.poll() is None, log.read_text()[-4000:]
            assert time.monotonic() < deadline, "tandem serve on the head did not become ready: " + log.read_text()[-4000:]
            try:
                if httpx.get(url + "/ready", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(1)
        yield url
    finally:
        proc.terminate()  # SIGTERM to the nsenter'd process group's leader; down kills the rest anyway
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
