"""Pools that grow onto a host Ray's autoscaler starts, and give it back: `ray up` (the local provider,
v1 autoscaler) with three worker "hosts" of one CPU each and `min_workers: 2`, so the cluster starts
with two of them (the 1 prefill + 1 decode workers fill both). `tandem scale --decode 2` on the head asks
for a worker no node has room for: it stays pending until Ray's autoscaler starts the third host, and
serves there. `tandem scale --decode 1` drains it; the idle host is then released by the autoscaler.

The changes to the shipped configs/cluster-local.yaml: the IPs, the SSH key, `python3` (as
test_ray_up.py), min/max workers and a short idle timeout, one CPU per worker host and none on the head
(so each worker needs a host of its own), and a pool config without the per-role custom resources (Ray's
autoscaler infers a local node type's CPUs from a running node, never its custom resources, so only a
CPU demand can start a host)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import yaml

from cluster.control.config import TandemConfig
from tests.helpers.cluster import CONFIGS
from tests.multinode.conftest import netns
from tests.multinode.ray_up import completion_on_head, namespaced_launcher, ray_cli, workers_by_host

pytestmark = pytest.mark.slow  # `ray up` onto namespaced hosts, one started later by Ray's autoscaler

HOSTS = {"head": None, "w1": None, "w2": None, "w3": None}
IDLE_TIMEOUT_MIN = 0.5


def _pools_by_cpu(tmp: Path) -> Path:
    config = TandemConfig.from_file(CONFIGS / "ray-up-local.yaml").model_dump(mode="json", exclude_none=True)
    for role in ("prefill", "decode"):
        config[role].update(resources={}, num_cpus=1, max_replicas=2)
    path = tmp / "autoscaling-serve.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


@pytest.fixture(scope="module")
def launcher_config(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ray-up-autoscaling")
    serve_config = _pools_by_cpu(tmp)

    def customize(config: dict) -> None:
        config.update(min_workers=2, max_workers=3, idle_timeout_minutes=IDLE_TIMEOUT_MIN)
        config["file_mounts"]["~/tandem-autoscaling.yaml"] = str(serve_config)
        config["head_start_ray_commands"] = [
            c.replace("--head --port=6379", "--head --num-cpus=0 --port=6379")
             .replace("~/tandem/configs/ray-up-local.yaml", "~/tandem-autoscaling.yaml")
            for c in config["head_start_ray_commands"]]
        config["worker_start_ray_commands"] = [
            c.replace('--resources="{\\"tandem_${TANDEM_RAY_ROLE:-decode}\\": 1}"', "--num-cpus=1")
            for c in config["worker_start_ray_commands"]]
        assert any("--num-cpus=0" in c for c in config["head_start_ray_commands"])
        assert any("--num-cpus=1" in c and "tandem_" not in c for c in config["worker_start_ray_commands"])

    yield from namespaced_launcher(tmp, HOSTS, customize)


def _alive_nodes() -> set[str]:
    script = ("import json, ray; ray.init(address='auto', log_to_driver=False); "
              "print(json.dumps(sorted(n['NodeManagerAddress'] for n in ray.nodes() if n['Alive'])))")
    out = netns("run", "head", "bash", "--login", "-c", f"~/venv/bin/python -c \"{script}\"", timeout_s=120)
    return set(json.loads(out.strip().splitlines()[-1]))


def _scale_on_head(decode: int) -> str:
    return netns("run", "head", "bash", "--login", "-c", f"~/venv/bin/tandem scale --decode {decode} --timeout 900",
                 timeout_s=960)


def test_a_pool_grows_onto_a_host_the_autoscaler_starts_and_gives_it_back(launcher_config):
    up = ray_cli("up", "-y", "--no-config-cache", str(launcher_config), timeout_s=900)
    assert up.returncode == 0, up.stdout[-3000:] + up.stderr[-3000:]
    deadline = time.monotonic() + 600
    while completion_on_head("Say this is a test") is None:
        assert time.monotonic() < deadline, netns("run", "head", "bash", "-c", "tail -30 ~/tandem-serve.log")
        time.sleep(5)
    head = netns("address", "head").strip()
    before = _alive_nodes()
    assert len(before - {head}) == 2, before  # min_workers: two of the three hosts

    asked = time.monotonic()
    said = _scale_on_head(2)  # returns once the new worker is registered, on a host started for it
    grown_s = time.monotonic() - asked
    assert "decode x2" in said, said
    grown = _alive_nodes()
    (new_host,) = grown - before
    placed = workers_by_host()
    assert "tandem-decode-1" in placed.get(new_host, []), placed
    answer = completion_on_head("Say this is a test")
    assert answer is not None and answer["choices"][0]["finish_reason"] == "length", answer

    asked = time.monotonic()
    said = _scale_on_head(1)
    assert "decode x1" in said and "removed decode-1" in said, said
    deadline = time.monotonic() + 60 * IDLE_TIMEOUT_MIN + 240  # the idle timeout, then the autoscaler's rounds
    while new_host in _alive_nodes():
        assert time.monotonic() < deadline, "Ray's autoscaler never released the idle host"
        time.sleep(5)
    released_s = time.monotonic() - asked
    assert _alive_nodes() == before
    assert completion_on_head("after the scale-down") is not None
    print(f"ray autoscaler: the decode pool grew onto a new host in {grown_s:.0f} s (start, setup, worker ready); "
          f"the host was released {released_s:.0f} s after the scale-down (idle timeout {60 * IDLE_TIMEOUT_MIN:.0f} s)")
    down = ray_cli("down", "-y", str(launcher_config), timeout_s=300)
    assert down.returncode == 0, down.stdout[-3000:] + down.stderr[-3000:]
