"""`ray up` onto namespaced "hosts" (tests/multinode): a launcher config for them, the Ray CLI of this
interpreter, and what a test asks the head."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Callable, Iterator

import pytest
import yaml

from tests.multinode.conftest import REPO, _can_run, _env, netns


def ray_cli(*args: str, timeout_s: float) -> subprocess.CompletedProcess:
    ray = Path(sys.executable).parent / "ray"  # the CLI of the Ray this test imports
    # As the README says: `ray up` with the local provider needs the v1 autoscaler (configs/cluster-local.yaml).
    env = {**_env(), "RAY_UP_enable_autoscaler_v2": "0"}
    return subprocess.run([str(ray), *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout_s)


def namespaced_launcher(tmp: Path, hosts: dict[str, str | None],
                        customize: Callable[[dict], None] = lambda config: None) -> Iterator[Path]:
    """configs/cluster-local.yaml for `hosts` (name -> TANDEM_RAY_ROLE, the head first), each a network
    namespace with an sshd and a home of its own, with a key made here and `python3` the interpreter running
    the tests (whose torch the venv reuses); `customize` edits it further. Everything is removed after."""
    why = _can_run()
    if why:
        pytest.skip(why)
    if subprocess.run(["sh", "-c", "command -v sshd && command -v rsync && command -v ssh-keygen && command -v flock"],
                      capture_output=True).returncode:
        pytest.skip("needs openssh-server, rsync and flock")
    key = tmp / "cluster_key"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True)
    path = tmp / "cluster-local.yaml"
    netns("down")
    try:
        netns("up", str(len(hosts) - 1))
        for host, role in hosts.items():
            netns("sshd", host, f"{key}.pub", *([f"TANDEM_RAY_ROLE={role}"] if role else []))
        config = yaml.safe_load((REPO / "configs" / "cluster-local.yaml").read_text())
        config["provider"].update(head_ip=netns("address", "head").strip(),
                                  worker_ips=[netns("address", h).strip() for h in hosts if h != "head"])
        config["auth"]["ssh_private_key"] = str(key)
        config["setup_commands"] = [c.replace("python3 -m venv", f"{sys.executable} -m venv")
                                    for c in config["setup_commands"]]
        customize(config)
        path.write_text(yaml.safe_dump(config, sort_keys=False))
        yield path
    finally:
        ray_cli("down", "-y", str(path), timeout_s=300)
        netns("down")


def completion_on_head(prompt: str) -> dict | None:
    body = json.dumps({"model": "tiny-llama", "prompt": prompt, "max_tokens": 8, "temperature": 0})
    try:
        out = netns("run", "head", "curl", "-sf", "http://127.0.0.1:8000/v1/completions",
                    "-H", "Content-Type: application/json", "-d", body, timeout_s=60)
    except RuntimeError:
        return None  # not serving yet
    return json.loads(out)


def workers_by_host() -> dict[str, list[str]]:
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


