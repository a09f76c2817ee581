"""`ray up` for real: configs/cluster-local.yaml (Ray's local provider) brings up a head and two worker
"hosts" (network namespaces, each with an sshd and a home of its own) over SSH with a key made here,
`tandem serve` starts on the head, and the README's completion request answers there; `ray down`
removes it all. The one change to the shipped config: its IPs, the SSH key, and `python3` (here, the
interpreter running this test, whose torch the venv reuses)."""

from __future__ import annotations

import time

import pytest

from tests.multinode.conftest import netns
from tests.multinode.ray_up import completion_on_head, namespaced_launcher, ray_cli, workers_by_host

pytestmark = pytest.mark.slow  # `ray up` onto namespaced hosts

HOSTS = {"head": None, "w1": "prefill", "w2": "decode"}


@pytest.fixture(scope="module")
def launcher_config(tmp_path_factory):
    yield from namespaced_launcher(tmp_path_factory.mktemp("ray-up"), HOSTS)


def test_ray_up_over_ssh_serves_a_completion(launcher_config):
    started = time.monotonic()
    up = ray_cli("up", "-y", "--no-config-cache", str(launcher_config), timeout_s=900)
    assert up.returncode == 0, up.stdout[-3000:] + up.stderr[-3000:]
    deadline = time.monotonic() + 600  # the autoscaler sets up and starts both workers, then serve retries
    answer = None
    while answer is None:
        assert time.monotonic() < deadline, netns("run", "head", "bash", "-c", "tail -30 ~/tandem-serve.log")
        time.sleep(5)
        answer = completion_on_head("Say this is a test")
    took = time.monotonic() - started
    choice = answer["choices"][0]
    assert choice["finish_reason"] == "length" and answer["usage"]["completion_tokens"] == 8, answer
    placed = workers_by_host()
    head, w1, w2 = (netns("address", h).strip() for h in HOSTS)
    assert "tandem-prefill-0" in placed.get(w1, []) and "tandem-decode-0" in placed.get(w2, []), placed
    assert "tandem-scheduler" in placed.get(head, []), placed
    print(f"ray up: serving {took:.0f} s after `ray up -y`; actors by host {placed}")
    down = ray_cli("down", "-y", str(launcher_config), timeout_s=300)
    assert down.returncode == 0, down.stdout[-3000:] + down.stderr[-3000:]
    assert completion_on_head("after ray down") is None
