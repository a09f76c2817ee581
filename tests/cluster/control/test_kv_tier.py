"""The per-node host KV tier (issue 55, first part) in a real Ray cluster on real shared memory: a
conversation's prefix that its worker's small pool evicted is loaded back from the tier by a later turn
(cached tokens reported, tier hits counted) with the greedy tokens of transformers and of the same run
without a tier; a second worker of the node reuses a prefix the first one evicted; with the tier off there
is no tier actor. Every tier's integrity is checked after each scenario."""

from __future__ import annotations

import dataclasses
import time

import pytest
import ray
import torch
from transformers import AutoModelForCausalLM

from actors.kv_tier.actor import TIER_PREFIX
from actors.protocol.sampling_params import SamplingParams
from cluster.control.lifecycle.launch import Cluster
from cluster.control.lifecycle.scaling import scale
from cluster.frontend.open_client import open_client
from tests.helpers.cluster import load, wait_restarted, wait_until_idle

BLOCKS = 24  # per worker: one conversation turn (~11 blocks) and a filler do not both stay cached
HOST_BYTES = 1 << 20  # 128 blocks of the tiny llama (8 KiB each)
STOCK = (HOST_BYTES // 8192) // 4  # slots each worker holds to write evictions into (a quarter of the tier)
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def _config(name: str, model_dir, host_bytes: int):
    config = load(name, num_kv_blocks=BLOCKS)
    update = {"model": config.model.model_copy(update={"path": str(model_dir)}),
              "kv_tier": config.kv_tier.model_copy(update={"host_bytes": host_bytes})}
    if name == "colocated.yaml":
        update["colocated"] = config.colocated.model_copy(update={"replicas": 1})
    else:  # every prompt through the prefill worker's pool: a filler the cost model prefilled on the decode
        # worker instead would leave turn one's blocks in the prefill pool, and turn two would need no tier
        update["scheduler"] = config.scheduler.model_copy(update={"local_prefill": False})
    return config.model_copy(update=update)


def _prompts():
    g = torch.Generator().manual_seed(5)
    first = torch.randint(5, 500, (160,), generator=g).tolist()  # 10 full blocks
    fillers = [torch.randint(5, 500, (170,), generator=g).tolist() for _ in range(4)]
    turn = torch.randint(5, 500, (20,), generator=g).tolist()
    return first, fillers, turn


def _transformers_greedy(model_dir, prompt: list[int], n: int) -> list[int]:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


def _tier_stats(cluster: Cluster) -> dict:
    """The node's tier's stats, its integrity checked (`wait_until_idle` checks every owner's, the tier's too)."""
    (tier,) = cluster.tiers.values()  # one node
    return dataclasses.asdict(ray.get(tier.check_integrity.remote(), timeout=30))


def _wait_tier(cluster: Cluster, done, what: str, timeout_s: float = 60.0) -> dict:
    """The tier's stats once `done(stats)`; fails naming `what` and the stats when `timeout_s` runs out."""
    deadline = time.monotonic() + timeout_s
    while not done(stats := _tier_stats(cluster)):
        assert time.monotonic() < deadline, f"the tier never reached {what}: {stats}"
        time.sleep(0.05)
    return stats


def _conversation(cluster: Cluster, tier: bool) -> tuple[list[int], list[int], int]:
    """Turn one, fillers that push its blocks out of the worker's pool, turn two (turn one + its answer + a
    new message); returns both answers and turn two's cached tokens."""
    first, fillers, turn = _prompts()
    client = open_client(cluster)
    (answer,), = client.generate([first], GREEDY)
    for filler in fillers:  # one at a time: each evicts what the one before left cached
        client.generate([filler], GREEDY)
    if tier:
        _wait_tier(cluster, lambda t: t["stores"] >= 10, "10 blocks stored")  # turn one's, written behind
    (second,), = client.generate([first + answer.token_ids + turn], GREEDY)
    return answer.token_ids, second.token_ids, second.num_cached_tokens


def _tiered_conversation(cluster: Cluster, model_dir) -> tuple[list[int], list[int]]:
    """`_conversation` with the tier on: turn two's prefix came (at least in part) from the tier, every token
    is transformers' greedy one, and the cluster ends idle with every owner's integrity checked."""
    first, _, turn = _prompts()
    answer, second, cached = _conversation(cluster, tier=True)
    assert cached >= 10 * 16, cached  # turn one's blocks: what the pool still had, the rest from the tier
    # Every hit loaded into a pool (the worker's unpin, which counts it, is written behind).
    stats = _wait_tier(cluster, lambda t: t["loads"] == t["hits"], "every hit loaded")
    assert stats["hits"] >= 1, stats
    assert answer == _transformers_greedy(model_dir, first, 8)
    assert second == _transformers_greedy(model_dir, first + answer + turn, 8)
    wait_until_idle(cluster)
    return answer, second


@pytest.fixture(scope="module")
def model_dir(hf_models):
    return hf_models["llama"]


def test_colocated_turn_reuses_its_evicted_prefix_and_a_second_worker_reuses_it_too(ray_session, model_dir):
    first, fillers, turn = _prompts()
    cluster = Cluster.start(_config("colocated.yaml", model_dir, HOST_BYTES))
    try:
        answer, second = _tiered_conversation(cluster, model_dir)
        # A second worker of this node, the first one gone: its pool never held the prefix, the tier does.
        scale(cluster, {"colocated": 2})
        ray.get(cluster.workers["colocated-0"].shutdown.remote(), timeout=60)
        cluster.stop_worker("colocated-0")
        _wait_forgotten(cluster, "colocated-0")
        hits_before = _tier_stats(cluster)["hits"]
        other = first + [7] * 17  # turn one's prefix under another continuation
        (third,), = open_client(cluster).generate([other], GREEDY)
        assert third.num_cached_tokens == 10 * 16
        _wait_tier(cluster, lambda t: t["hits"] >= hits_before + 10 and t["loads"] == t["hits"], "10 more hits loaded")
        assert third.token_ids == _transformers_greedy(model_dir, other, 8)
        wait_until_idle(cluster)
    finally:
        cluster.shutdown()
    off = Cluster.start(_config("colocated.yaml", model_dir, 0))
    try:
        assert off.tiers == {}
        assert not [a for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].startswith(TIER_PREFIX)]
        off_answer, off_second, off_cached = _conversation(off, tier=False)
        assert (off_answer, off_second) == (answer, second)  # the same tokens without a tier
        assert off_cached < 10 * 16, off_cached  # ... where the pool alone had lost the prefix
        wait_until_idle(off)
    finally:
        off.shutdown()


def test_disaggregated_turn_reuses_its_evicted_prefix_and_serves_on_when_the_tier_dies(ray_session, model_dir):
    first, _, turn = _prompts()
    cluster = Cluster.start(_config("local.yaml", model_dir, HOST_BYTES))
    try:
        answer, second = _tiered_conversation(cluster, model_dir)
        # A worker Ray restarts attaches again as a new process: the tier takes back what the dead one held.
        prefill = "prefill-0-" + ray.get(cluster.workers["prefill-0"].incarnation.remote(), timeout=30)
        ray.kill(cluster.workers["decode-0"], no_restart=False)
        decode = "decode-0-" + wait_restarted(cluster, "decode-0")
        _wait_tier(cluster, lambda t: (t["leased"], t["clients"]) == (2 * STOCK, (decode, prefill)),
                   f"{2 * STOCK} slots leased to the live processes {decode}, {prefill} only")
        # The tier actor dies: the workers serve on without it, the same tokens.
        for tier in cluster.tiers.values():
            ray.kill(tier, no_restart=True)
        (again,), = open_client(cluster).generate([first + answer + turn], GREEDY)
        assert again.token_ids == second
    finally:
        cluster.shutdown()


def _wait_forgotten(cluster: Cluster, worker_id: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while worker_id in ray.get(cluster.scheduler.state.remote(), timeout=30).workers:
        assert time.monotonic() < deadline, f"the scheduler still lists {worker_id} after {timeout_s}s"
        time.sleep(0.1)
