"""Live pool resizing under load: `tandem scale` up and down with no failed request and no leaked block,
and the same through an edit of the served config file."""

from __future__ import annotations

import time

import pytest
import ray
import yaml

from actors.engine.engine import Engine
from actors.protocol.sampling_params import SamplingParams
from cluster.frontend.open_client import open_client
from tandem.cli import main as tandem
from cluster.control.lifecycle.launch import NAMESPACE, Cluster
from cluster.control.lifecycle.scaling import ConfigWatcher, ResizeInProgress, scale
from tests.helpers.cluster import CONFIGS, ClosedLoop, load, wait_until_idle, wait_until_resized

pytestmark = pytest.mark.slow  # pools resized under load

PROMPTS = [list(range(10 + 7 * i, 40 + 11 * i)) for i in range(8)]
PARAMS = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)


@pytest.fixture(scope="module")
def expected():
    engine = Engine(load("local.yaml").engine_config())
    return [r.outputs[0].token_ids for r in engine.generate(PROMPTS, PARAMS)]


def Load(cluster: Cluster, expected: list[list[int]], threads: int = 4) -> ClosedLoop:
    return ClosedLoop(cluster, PROMPTS, PARAMS, expected, threads)


def assert_clean(cluster: Cluster) -> dict:
    state = wait_until_idle(cluster)
    for stats in state["workers"].values():
        assert stats["used_blocks"] == stats["reserved"] == stats["held"] == stats["live_requests"] == 0, stats
    assert state["scheduler"]["in_flight"] == 0
    assert set(state["scheduler"]["workers"]) == set(cluster.workers)
    return state


def worker_stats(cluster: Cluster) -> dict:
    return ray.get(cluster.scheduler.state.remote(), timeout=10).as_dict()["worker_stats"]


def test_scale_up_and_down_under_load_fails_nothing(server, expected):  # noqa: F811
    cluster, base = server
    load_ = Load(cluster, expected)
    try:
        load_.wait_done(4)  # the resize comes under load
        assert tandem(["scale", "--prefill", "2", "--decode", "2", "--url", base]) == 0
        assert sorted(cluster.workers) == ["decode-0", "decode-1", "prefill-0", "prefill-1"]
        # The load's prompts are cached on prefill-0 and cache-aware routing keeps them there; fresh
        # prompts arriving together queue on prefill-0 and spill onto the new worker.
        client, fresh = open_client(cluster), iter(range(1000, 100000, 37))
        deadline = time.monotonic() + 60
        while not (worker_stats(cluster).get("decode-1", {}).get("adopted", 0) > 0
                   and worker_stats(cluster).get("prefill-1", {}).get("transfers_sent", 0) > 0):
            assert time.monotonic() < deadline, "the new workers never took work"
            prompts = [[(start + 7 * k) % 2000 + 10 for k in range(200)] for start in [next(fresh) for _ in range(4)]]
            results = client.generate(prompts, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
            assert all(r[0].finish_reason == "length" for r in results)
        assert tandem(["scale", "--prefill", "1", "--decode", "1", "--url", base]) == 0
    finally:
        load_.stop()
    assert load_.bad == [], load_.bad[:3]
    assert load_.done > 20
    assert sorted(cluster.workers) == ["decode-0", "prefill-0"]
    for gone in ("prefill-1", "decode-1"):
        with pytest.raises(ValueError):
            ray.get_actor(f"tandem-{gone}", namespace=NAMESPACE)
    assert_clean(cluster)


def test_a_resize_that_does_not_wait_lets_the_next_come_while_workers_start_and_drain(server, expected):  # noqa: F811
    """The autoscaler's resizes (`wait=False`): each returns while its new worker loads, the next one may
    come meanwhile, a pool whose new worker still starts is not shrunk, and under load nothing fails."""
    cluster, _ = server
    sizes = {role: pool.replicas for role, pool in cluster.config.pools().items()}
    load_ = Load(cluster, expected)
    try:
        first = scale(cluster, {"decode": sizes["decode"] + 1}, wait=False)
        (new,) = first["added"]
        assert new in cluster.resizes.starting  # returned while it loads (a cold start here takes seconds)
        assert first["replicas"]["decode"] == cluster.config.decode.replicas == sizes["decode"] + 1
        second = scale(cluster, {"prefill": sizes["prefill"] + 1}, wait=False)  # no ResizeInProgress
        with pytest.raises(ResizeInProgress, match="still starting"):
            scale(cluster, {"decode": sizes["decode"]}, wait=False)
        cluster.resizes.check_integrity(cluster)
        wait_until_resized(cluster)
        for added in first["added"] + second["added"]:
            assert ray.get(cluster.workers[added].info.remote(), timeout=30).worker_id == added
        shrink = scale(cluster, sizes, wait=False)
        assert len(shrink["removed"]) == 2 and cluster.config.pools()["decode"].replicas == sizes["decode"]
        wait_until_resized(cluster)
    finally:
        load_.stop()
    assert load_.bad == [], load_.bad[:3]
    assert not set(shrink["removed"]) & set(cluster.workers)
    assert {role: pool.replicas for role, pool in cluster.config.pools().items()} == sizes
    assert_clean(cluster)


def test_a_new_worker_that_does_not_start_in_time_is_stopped_and_the_count_falls_back(server):  # noqa: F811
    """The failure path of a start, forced by a ready timeout no worker meets here (a cold start takes
    seconds): waited for, it is the caller's error; not waited for, the pool's count falls back."""
    cluster, _ = server
    before = {role: pool.replicas for role, pool in cluster.config.pools().items()}
    workers = set(cluster.workers)
    with pytest.raises(ValueError, match="not ready within"):
        scale(cluster, {"decode": before["decode"] + 1}, ready_timeout_s=0.01)
    assert set(cluster.workers) == workers and cluster.config.decode.replicas == before["decode"]
    result = scale(cluster, {"decode": before["decode"] + 1}, ready_timeout_s=0.01, wait=False)
    assert cluster.config.decode.replicas == before["decode"] + 1  # the target, until the start fails
    wait_until_resized(cluster)
    assert not set(result["added"]) & set(cluster.workers) and cluster.config.decode.replicas == before["decode"]
    cluster.resizes.check_integrity(cluster)
    assert_clean(cluster)


def test_a_removed_worker_cannot_register_again(server):  # noqa: F811
    """A drained worker's late register call (a report it sent before stopping was answered "unknown")
    is refused: it would come back as a ghost the scheduler routes to."""
    cluster, base = server
    before = set(cluster.workers)
    assert tandem(["scale", "--decode", "2", "--url", base]) == 0
    (added,) = set(cluster.workers) - before
    info = ray.get(cluster.workers[added].info.remote(), timeout=30)
    assert tandem(["scale", "--decode", "1", "--url", base]) == 0
    assert ray.get(cluster.scheduler.register.remote(info, None, []), timeout=30) is False
    assert added not in ray.get(cluster.scheduler.state.remote(), timeout=10).workers
    assert_clean(cluster)


def test_bad_resizes_are_refused_and_change_nothing(server, capsys):  # noqa: F811
    cluster, base = server
    before = sorted(cluster.workers)
    assert tandem(["scale", "--colocated", "2", "--url", base]) == 2
    assert "no colocated pool" in capsys.readouterr().err
    assert tandem(["scale", "--decode", "0", "--url", base]) == 2
    assert "decode" in capsys.readouterr().err
    assert tandem(["scale", "--url", base]) == 2
    assert sorted(cluster.workers) == before


def test_an_edit_of_the_config_file_resizes_the_pools(server, tmp_path, caplog):  # noqa: F811
    cluster, _ = server
    path = tmp_path / "served.yaml"
    raw = yaml.safe_load((CONFIGS / "local.yaml").read_text())

    def write(**changes) -> None:
        config = cluster.config.model_dump()
        for role, n in changes.items():
            config[role]["replicas"] = n
        path.write_text(yaml.safe_dump(config))
        time.sleep(0.05)

    write()
    watcher = ConfigWatcher(cluster, path, interval_s=0.2).start()
    try:
        write(decode=2)
        deadline = time.monotonic() + 60
        while len([w for w in cluster.workers if w.startswith("decode")]) != 2:
            assert time.monotonic() < deadline, "the config edit did not add a decode worker"
            time.sleep(0.1)
        # A change a live cluster cannot apply is refused (logged) and changes nothing.
        bad = cluster.config.model_dump()
        bad["engine"]["block_size"] = 32
        path.write_text(yaml.safe_dump(bad))
        deadline = time.monotonic() + 60
        while not [r for r in caplog.records if r.name == "tandem.scaling" and "not applied" in r.getMessage()]:
            assert time.monotonic() < deadline, "the watcher never read the bad edit"
            time.sleep(0.05)
        assert len(cluster.workers) == 3
        write(decode=1)
        deadline = time.monotonic() + 60
        while len(cluster.workers) != 2:
            assert time.monotonic() < deadline, "the config edit did not remove the decode worker"
            time.sleep(0.1)
    finally:
        watcher.stop()
    assert raw["mode"] == cluster.config.mode
    (r,) = open_client(cluster).generate([PROMPTS[0]], PARAMS)[0]
    assert r.finish_reason == "length"
    assert_clean(cluster)
