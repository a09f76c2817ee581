"""Tensor-parallel workers in a cluster (gloo on CPU): colocated TP=2 and TP=4 (more ranks than KV heads)
give the single-process engine's greedy tokens, with no socket of theirs open on every interface (the
group's rendezvous closes once it has formed); losing a rank restarts the whole group as one worker,
and the streams it was serving migrate and finish with the fault-free tokens; a resize adds and removes
whole groups, placement groups included."""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import subprocess
import time

import pytest
import ray
from ray._private import state

from actors.engine.engine import Engine
from cluster.control.config import TandemConfig
from cluster.control.lifecycle.launch import Cluster
from cluster.frontend.open_client import open_client
from tests.helpers.cluster import generate_in_background, load, wait_until_idle, workload

pytestmark = pytest.mark.slow  # tensor-parallel clusters, ranks killed


def _tp_config(size: int, replicas: int = 1, **engine) -> TandemConfig:
    config = load("colocated.yaml")
    pool = config.colocated.model_copy(update={"replicas": replicas, "tensor_parallel_size": size})
    return config.model_copy(update={"colocated": pool,
                                     "engine": config.engine.model_copy(update=engine) if engine else config.engine})


def _expected(config: TandemConfig, prompts, params):
    engine = Engine(config.engine_config())
    return [r.outputs[0].token_ids for r in engine.generate(prompts, params)]


@pytest.mark.parametrize("size", [2, 4])
def test_colocated_tp_matches_the_engine(ray_session, size):
    prompts, params = workload(12)
    config = _tp_config(size)
    expected = _expected(config, prompts, params)
    cluster = Cluster.start(config)
    try:
        got = open_client(cluster).generate(prompts, params)
        assert [r[0].token_ids for r in got] == expected
        state = wait_until_idle(cluster)
        assert all(w["used_blocks"] == 0 for w in state["workers"].values()), state["workers"]
        (worker,) = cluster.workers.values()
        assert len(ray.get(worker.tensor_parallel_ranks.remote(), timeout=30)) == size - 1
        assert _open_to_the_network(cluster) == []
    finally:
        cluster.shutdown()
    assert not cluster.groups  # the placement groups went with their workers


def _open_to_the_network(cluster: Cluster) -> list[str]:
    """Listening sockets of the workers' processes (rank 0 and its ranks) on every interface, less Ray's own
    core-worker port of each (Ray's, not ours: every actor has one)."""
    if shutil.which("ss") is None:
        pytest.skip("needs ss (iproute2)")
    ray_ports = {(a.get("Pid"), a["Address"]["Port"]) for a in state.actors().values() if a["State"] == "ALIVE"}
    pids = set()
    for handle in cluster.workers.values():
        for actor in [handle, *ray.get(handle.tensor_parallel_ranks.remote(), timeout=30)]:
            pids.add(ray.get(actor.__ray_call__.remote(lambda _: os.getpid()), timeout=30))
    open_ = []
    for line in subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True, check=True).stdout.splitlines():
        local, owner = line.split()[3], line.split()[-1]
        pid = next((int(p) for p in re.findall(r"pid=(\d+)", owner) if int(p) in pids), None)
        host, _, port = local.rpartition(":")
        if pid is not None and host in ("*", "0.0.0.0", "[::]") and (pid, int(port)) not in ray_ports:
            open_.append(line)
    return open_


def test_losing_a_rank_restarts_the_group_and_streams_migrate(ray_session):
    prompts, params = workload(6)
    params = [dataclasses.replace(p, max_tokens=48) for p in params]
    config = _tp_config(2)
    expected = _expected(config, prompts, params)
    cluster = Cluster.start(config)
    try:
        (worker,) = cluster.workers.values()
        (rank1,) = ray.get(worker.tensor_parallel_ranks.remote(), timeout=30)
        incarnation = ray.get(worker.info.remote(), timeout=30).incarnation
        runner, out = generate_in_background(cluster, prompts, params)
        deadline = time.monotonic() + 60
        while True:  # mid-stream: decoding, nothing left to prefill
            stats = ray.get(worker.check_integrity.remote(), timeout=30)
            if stats.running > 0 and stats.waiting == 0 and stats.queued_prefill_tokens == 0:
                break
            assert time.monotonic() < deadline, "the requests never started"
            time.sleep(0.01)
        ray.kill(rank1, no_restart=True)
        runner.join(timeout=300)
        assert [g[0].token_ids for g in out["got"]] == expected
        assert ray.get(worker.info.remote(), timeout=60).incarnation != incarnation  # a new group, one worker
        assert len(ray.get(worker.tensor_parallel_ranks.remote(), timeout=30)) == 1
        state = wait_until_idle(cluster)
        assert state["scheduler"]["in_flight"] == 0
        assert state["scheduler"]["counters"]["workers_lost"] == 1, state["scheduler"]["counters"]
    finally:
        cluster.shutdown()


def test_scaling_adds_and_removes_whole_groups(ray_session):
    from cluster.control.lifecycle.scaling import scale

    prompts, params = workload(8)
    config = _tp_config(2)
    expected = _expected(config, prompts, params)
    cluster = Cluster.start(config)
    try:
        added = scale(cluster, {"colocated": 2})["added"]
        assert len(added) == 1 and set(cluster.groups) == set(cluster.workers)  # a placement group per worker
        (new,) = added
        assert len(ray.get(cluster.workers[new].tensor_parallel_ranks.remote(), timeout=30)) == 1
        got = open_client(cluster).generate(prompts, params)
        assert [r[0].token_ids for r in got] == expected
        state = wait_until_idle(cluster)
        assert all(w["used_blocks"] == 0 for w in state["workers"].values())
        removed = scale(cluster, {"colocated": 1})["removed"]
        assert removed == [new] and set(cluster.groups) == set(cluster.workers) and len(cluster.groups) == 1
    finally:
        cluster.shutdown()


def test_tp_with_the_collective_transport_is_refused():
    config = load("local.yaml")
    with pytest.raises(ValueError, match="tensor_parallel_size > 1 needs transfer.backend zmq"):
        TandemConfig.model_validate({**config.model_dump(), "prefill": {"tensor_parallel_size": 2},
                                     "transfer": {"backend": "collective"}})
