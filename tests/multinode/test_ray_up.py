"""`ray up` for real: configs/cluster-local.yaml (Ray's local provider) brings up a head and two worker
"hosts" (network namespaces, each with an sshd and a home of its own) over SSH with a key made here,
`tandem serve` starts on the head, and the README's completion request answers there; `ray down`
removes it all. The one change to the shipped config: its IPs, the SSH key, and `python3` (here, the
interpreter running this test, whose torch the venv reuses)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tests.multinode.conftest import REPO, _can_run, _env, netns

pytestmark = pytest.mark.slow  # `ray up` onto namespaced hosts

HOSTS = {"head": None, "w1": "prefill", "w2": "decode"}


def _ray_cli(*args: str, timeout_s: float) -> subprocess.CompletedProcess:
    ray = Path(sys.executable).parent / "ray"  # the CLI of the Ray this test imports
    # As the README says: `ray up` with the local provider needs the v1 autoscaler (configs/cluster-local.yaml).
    env = {**_env(), "RAY_UP_enable_autoscaler_v2": "0"}
    return subprocess.run([str(ray), *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout_s)


@pytest.fixture(scope="module")
def launcher_config(tmp_path_factory):
    why = _can_run()
    if why:
        pytest.skip(why)
    if subprocess.run(["sh", "-c", "command -v sshd && command -v rsync && command -v ssh-keygen && command -v flock"],
                      capture_output=True).returncode:
        pytest.skip("needs openssh-server, rsync and flock")
    tmp = tmp_path_factory.mktemp("ray-up")
    key = tmp / "cluster_key"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True)
    netns("down")
    try:
        netns("up", str(len(HOSTS) - 1))
        for host, role in HOSTS.items():
            netns("sshd", host, f"{key}.pub", *([f"TANDEM_RAY_ROLE={role}"] if role else []))
        config = yaml.safe_load((REPO / "configs" / "cluster-local.yaml").read_text())
        config["provider"].update(head_ip=netns("address", "head").strip(),
                                  worker_ips=[netns("address", h).strip() for h in HOSTS if h != "head"])
        config["auth"]["ssh_private_key"] = str(key)
        config["setup_commands"] = [c.replace("python3 -m venv", f"{sys.executable} -m venv")
                                    for c in config["setup_commands"]]
        path = tmp / "cluster-local.yaml"
        path.write_text(yaml.safe_dump(config, sort_keys=False))
        yield path
    finally:
        _ray_cli("down", "-y", str(tmp / "cluster-local.yaml"), timeout_s=300)
        netns("down")


def _completion_on_head(prompt: str) -> dict | None:
    body = json.dumps({"model": "tiny-llama", "prompt": prompt, "max_tokens": 8, "temperature": 0})
    try:
        out = netns("run", "head", "curl", "-sf", "http://127.0.0.1:8000/v1/completions",
                    "-H", "Content-Type: application/json", "-d", body, timeout_s=60)
    except RuntimeError:
        return None  # not serving yet
    return json.loads(out)


def _workers_by_host() -> dict[str, list[str]]:
    """Which tandem actors each host's Ray node runs (from a driver on the head)."""
    script = ("import json, ray; from ray._private import state; ray.init(address='auto', log_to_driver=False); "
              "ips = {n['NodeID']: n['NodeManagerAddress'] for n in ray.nodes()}; "
              "print(json.dumps([[a.get('Name'), ips.get(a['Address'].get('NodeID'))] "
              "for a in state.actors().values() if a.get('State') == 'ALIVE']))")
    out = netns("run", "head", "bash", "--login", "-c", f"~/venv/bin/python -c \"{script}\"", timeout_s=120)
    placed: dict[str, list[str]] = {}
    for name, ip in json.loads(out.strip().splitlines()[-1]):
        placed.setdefault(ip, []).append(name)
    return placed


def test_ray_up_over_ssh_serves_a_completion(launcher_config):
    started = time.monotonic()
    up = _ray_cli("up", "-y", "--no-config-cache", str(launcher_config), timeout_s=900)
    assert up.returncode == 0, up.stdout[-3000:] + up.stderr[-3000:]
    deadline = time.monotonic() + 600  # the autoscaler sets up and starts both workers, then serve retries
    answer = None
    while answer is None:
        assert time.monotonic() < deadline, netns("run", "head", "bash", "-c", "tail -30 ~/tandem-serve.log")
        time.sleep(5)
        answer = _completion_on_head("Say this is a test")
    took = time.monotonic() - started
    choice = answer["choices"][0]
    assert choice["finish_reason"] == "length" and answer["usage"]["completion_tokens"] == 8, answer
    placed = _workers_by_host()
    head, w1, w2 = (netns("address", h).strip() for h in HOSTS)
    assert "tandem-prefill-0" in placed.get(w1, []) and "tandem-decode-0" in placed.get(w2, []), placed
    assert "tandem-scheduler" in placed.get(head, []), placed
    print(f"ray up: serving {took:.0f} s after `ray up -y`; actors by host {placed}")
    down = _ray_cli("down", "-y", str(launcher_config), timeout_s=300)
    assert down.returncode == 0, down.stdout[-3000:] + down.stderr[-3000:]
    assert _completion_on_head("after ray down") is None
