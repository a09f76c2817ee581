"""The KV handoff between pools of different tensor-parallel sizes (gloo on CPU): each decode rank
receives exactly its KV heads, from the prefill ranks that hold them, and no rank sends another's; the
greedy tokens equal the single-process engine's. Layouts: 4 KV heads, P TP=2 -> D TP=1 and P TP=1 ->
D TP=2; 2 KV heads over 4 ranks (replicated), P TP=4 -> D TP=1 and P TP=1 -> D TP=4. Then a rank of a
TP=2 decode group is killed mid-stream: the streams migrate and finish with the fault-free tokens."""

from __future__ import annotations

import dataclasses
import time

import pytest
import ray

from actors.engine.engine import Engine
from actors.engine.model.parallel import TPShard
from cluster.control.config import TandemConfig
from cluster.control.lifecycle.launch import Cluster
from cluster.frontend.open_client import open_client
from tests.helpers.cluster import generate_in_background, load, wait_until_idle, workload
from tests.helpers.models import make_hf_model

pytestmark = pytest.mark.slow  # tensor-parallel clusters of up to 5 processes a worker

HEAD_DIM, LAYERS, BLOCK = 16, 2, 16  # of the 4-KV-head model below


@pytest.fixture(scope="module")
def kv4_model(tmp_path_factory):
    """A random Llama with 4 query and 4 KV heads, and the workload's vocabulary."""
    return str(make_hf_model(tmp_path_factory.mktemp("kv4"), "llama", num_key_value_heads=4, vocab_size=2048,
                             max_position_embeddings=2048, rope_scaling=None))


def _config(model: str | None, prefill_tp: int, decode_tp: int) -> TandemConfig:
    config = load("local.yaml")
    update = {
        "prefill": config.prefill.model_copy(update={"tensor_parallel_size": prefill_tp}),
        "decode": config.decode.model_copy(update={"tensor_parallel_size": decode_tp}),
        # Every prompt is prefilled on the prefill pool and handed off (none prefilled on the decode worker).
        "scheduler": config.scheduler.model_copy(update={"local_prefill": False}),
    }
    if model is not None:
        update["model"] = config.model.model_copy(update={"path": model})
    return config.model_copy(update=update)


def _expected(config: TandemConfig, prompts, params):
    engine = Engine(config.engine_config())
    return [r.outputs[0].token_ids for r in engine.generate(prompts, params)], engine.kv_heads[0]


def _kv_bytes(cluster: Cluster, worker_id: str) -> list[tuple[int, int]]:
    """(sent, received) page bytes of each rank of a worker."""
    worker = cluster.workers[worker_id]
    ranks = ray.get(worker.tensor_parallel_ranks.remote(), timeout=30)
    return ray.get([worker.kv_bytes.remote()] + [r.kv_bytes.remote() for r in ranks], timeout=30)


def _heads(total: int, num_heads: int, size: int) -> list[set[int]]:
    return [set(range(*TPShard(r, size).kv_heads(total, num_heads))) for r in range(size)]


@pytest.mark.parametrize("kv_heads, prefill_tp, decode_tp", [(4, 2, 1), (4, 1, 2), (2, 4, 1), (2, 1, 4)],
                         ids=["kv4-p2-d1", "kv4-p1-d2", "kv2-p4-d1", "kv2-p1-d4"])
def test_handoff_between_tp_sizes_sends_each_rank_its_heads(ray_session, kv4_model, kv_heads, prefill_tp, decode_tp):
    prompts, params = workload(10)
    config = _config(kv4_model if kv_heads == 4 else None, prefill_tp, decode_tp)
    expected, total = _expected(config, prompts, params)
    assert total == kv_heads
    cluster = Cluster.start(config)
    try:
        got = open_client(cluster).generate(prompts, params, timeout_s=240)
        assert [r[0].token_ids for r in got] == expected
        state = wait_until_idle(cluster)
        assert all(w["used_blocks"] == 0 for w in state["workers"].values()), state["workers"]
        sent = [s for s, _ in _kv_bytes(cluster, "prefill-0")]
        received = [r for _, r in _kv_bytes(cluster, "decode-0")]
    finally:
        cluster.shutdown()
    # Bytes of one KV head of one block (K and V, every layer), from decode rank 0's share.
    prefill_heads, decode_heads = _heads(total, 4, prefill_tp), _heads(total, 4, decode_tp)
    per_head = received[0] // len(decode_heads[0])
    assert per_head > 0 and per_head % (2 * LAYERS * BLOCK * HEAD_DIM * 4) == 0
    # Each decode rank received its heads once, and nothing else.
    assert received == [per_head * len(h) for h in decode_heads]
    # Each prefill rank sent only heads it holds and no lower rank holds, once to every decode rank holding them.
    owned = [h - set().union(*prefill_heads[:r]) for r, h in enumerate(prefill_heads)]
    assert sent == [per_head * sum(sum(h in d for d in decode_heads) for h in mine) for mine in owned]
    assert sum(sent) == sum(received)


def test_losing_a_decode_rank_migrates_the_streams(ray_session, kv4_model):
    prompts, params = workload(6)
    params = [dataclasses.replace(p, max_tokens=48) for p in params]
    config = _config(kv4_model, 1, 2)
    expected, _ = _expected(config, prompts, params)
    cluster = Cluster.start(config)
    try:
        worker = cluster.workers["decode-0"]
        (rank1,) = ray.get(worker.tensor_parallel_ranks.remote(), timeout=30)
        incarnation = ray.get(worker.info.remote(), timeout=30).incarnation
        runner, out = generate_in_background(cluster, prompts, params)
        deadline = time.monotonic() + 60
        while ray.get(worker.check_integrity.remote(), timeout=30).running < 3:  # mid-stream on the decode group
            assert time.monotonic() < deadline, "the requests never reached the decode worker"
            time.sleep(0.01)
        ray.kill(rank1, no_restart=True)
        runner.join(timeout=300)
        assert [g[0].token_ids for g in out["got"]] == expected
        info = ray.get(worker.info.remote(), timeout=60)
        assert info.incarnation != incarnation and len(info.kv_endpoints) == 2  # one new group, both ranks
        state = wait_until_idle(cluster)
        assert state["scheduler"]["in_flight"] == 0
        assert state["scheduler"]["counters"]["workers_lost"] == 1, state["scheduler"]["counters"]
        # The restarted group serves handoffs again.
        again = open_client(cluster).generate(prompts[:3], params[:3], timeout_s=120)
        assert [g[0].token_ids for g in again] == expected[:3]
        wait_until_idle(cluster)
    finally:
        cluster.shutdown()


def test_a_rank_whose_kv_receiver_dies_restarts_the_group(ray_session, kv4_model):
    """Rank 1 of a TP=2 decode group loses its receiving thread: the rank ends, the group restarts as one
    worker, and handoffs land again (before, every one would have waited out its lease)."""
    prompts, params = workload(4)
    config = _config(kv4_model, 1, 2)
    expected, _ = _expected(config, prompts, params)
    cluster = Cluster.start(config)
    try:
        worker = cluster.workers["decode-0"]
        incarnation = ray.get(worker.info.remote(), timeout=30).incarnation
        (rank1,) = ray.get(worker.tensor_parallel_ranks.remote(), timeout=30)
        ray.get(rank1.kill_kv_receiver.remote(), timeout=30)
        deadline = time.monotonic() + 120
        while True:
            try:
                if ray.get(worker.info.remote(), timeout=30).incarnation != incarnation:
                    break
            except ray.exceptions.RayActorError:
                pass  # restarting
            assert time.monotonic() < deadline, "the group did not restart"
            time.sleep(0.2)
        got = open_client(cluster).generate(prompts, params, timeout_s=240)
        assert [r[0].token_ids for r in got] == expected
        wait_until_idle(cluster)
    finally:
        cluster.shutdown()
