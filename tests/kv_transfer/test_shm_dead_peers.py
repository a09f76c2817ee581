"""Finding 8 of issue 52: a prefill worker kept the shared-memory lane of every decode worker it had ever
sent to, dropping one only on a failed send or at close. A killed decode worker comes back with a new
endpoint, so no send to the old one ever fails: after two SIGKILLs the prefill worker held 4 segments
mapped (2 -> 166 MB of /dev/shm, unlinked, so `ls` showed nothing). Now a sender drops the lanes of
receivers it sees dead (shm_pages.ShmLanes.drop_dead): here, after two SIGKILLs of the decode worker, the
prefill worker's process maps exactly one lane, the live decode worker's."""

from __future__ import annotations

import os
import signal
import time

import pytest
import ray

from actors.protocol.sampling_params import SamplingParams
from cluster.control.lifecycle.launch import Cluster
from cluster.frontend.open_client import open_client
from kv_transfer.shm_segment import PREFIX
from tests.helpers.cluster import load

pytestmark = pytest.mark.slow  # a cluster whose decode worker is killed twice

WAIT_S = 240.0


@pytest.fixture(scope="module")
def cluster(ray_session):
    config = load("local.yaml")
    assert config.transfer.zmq_transport == "ipc" and config.transfer.shm
    # Every prompt prefilled on the prefill worker and its pages handed off: no local prefill on decode.
    config = config.model_copy(update={"scheduler": config.scheduler.model_copy(update={"local_prefill": False})})
    live = Cluster.start(config)
    yield live
    live.shutdown()


def pid_of(handle) -> int:
    return ray.get(handle.__ray_call__.remote(lambda self: os.getpid()), timeout=60)


def mapped_lanes(pid: int) -> dict[str, int]:
    """Shared-memory segments process `pid` maps (by name) and their mapped bytes, from /proc: what the
    finding counted (their names are gone from /dev/shm once a receiver opened them)."""
    lanes: dict[str, int] = {}
    with open(f"/proc/{pid}/maps") as f:
        for line in f:
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and f"/{PREFIX}" in fields[5]:
                start, end = (int(x, 16) for x in fields[0].split("-"))
                name = os.path.basename(fields[5].split()[0])
                lanes[name] = lanes.get(name, 0) + end - start
    return lanes


def incarnation(cluster: Cluster, worker_id: str) -> str | None:
    return ray.get(cluster.scheduler.state.remote(), timeout=30).incarnations.get(worker_id)


def hand_off(cluster: Cluster, tag: int) -> None:
    """A request whose pages go from the prefill worker to the decode worker (retried while a restarted
    decode worker is still joining)."""
    client = open_client(cluster)
    deadline = time.monotonic() + WAIT_S
    while True:
        [[result]] = client.generate([[11 + tag, 12, 13, 14] * 8], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
        if result.finish_reason == "length":
            return
        assert time.monotonic() < deadline, f"no handoff succeeded within {WAIT_S} s: {result}"
        time.sleep(0.5)


def test_lanes_of_killed_decode_workers_are_dropped(cluster):
    prefill = pid_of(cluster.workers["prefill-0"])
    hand_off(cluster, 0)
    first = mapped_lanes(prefill)
    assert len(first) == 1, first
    for kill in range(2):
        decode = cluster.workers["decode-0"]
        before = incarnation(cluster, "decode-0")
        os.kill(pid_of(decode), signal.SIGKILL)
        deadline = time.monotonic() + WAIT_S
        while incarnation(cluster, "decode-0") in (None, before):
            assert time.monotonic() < deadline, f"decode-0 did not come back within {WAIT_S} s after kill {kill}"
            time.sleep(0.2)
        hand_off(cluster, kill + 1)
    # The live decode worker's lane only (a send checks for dead receivers at most once a second: one
    # more handoff may be the one that finds the second corpse).
    deadline = time.monotonic() + 60
    while len(lanes := mapped_lanes(prefill)) != 1:
        assert time.monotonic() < deadline, f"prefill still maps {len(lanes)} lanes after two kills: {lanes}"
        time.sleep(1.1)
        hand_off(cluster, 9)
    assert set(lanes) != set(first)  # the first decode process's lane went
    assert sum(lanes.values()) == sum(first.values())  # as much shared memory as one live peer needs
    cluster.check_integrity()
