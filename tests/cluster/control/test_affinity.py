"""Affinity keys (`GenerateRequest.affinity`, the HTTP `prompt_cache_key`): the map's bounds, the routing
rule, and on a real 2P+2D cluster, conversations whose turns share a prefix shorter than a block (so the
prefix index has nothing to go on) staying on one prefill worker with the key and spreading without it."""

from __future__ import annotations

import asyncio
import random

import pytest

from actors.protocol.sampling_params import SamplingParams
from cluster.control.scheduler.affinity import AffinityMap, Served
from cluster.control.lifecycle.launch import Cluster
from cluster.control.scheduler.routing import AFFINITY_SLACK_FLOOR_S, AFFINITY_SLACK_PROMPTS, PrefillPlan, WorkerView, pick_decode, prefer_affine
from cluster.frontend.open_client import open_client
from tests.helpers.cluster import load, wait_until_idle, wait_until_reported

COST = 0.001  # s per prompt token, every worker


def test_the_map_keeps_the_most_recently_used_keys_and_forgets_a_leaving_worker():
    keys = AffinityMap(capacity=3)
    keys.served(("a", "k1"), "p0", "d0")
    keys.served(("a", "k2"), "p1", "d0")
    keys.served(("b", "k1"), "p0", "d1")  # another tenant's key of the same name: its own entry
    assert keys.get(("a", "k1")) == Served("p0", "d0")  # used: now the most recent
    keys.served(("a", "k3"), "p1", "d1")  # past capacity: the least recently used, (a, k2), goes
    assert keys.get(("a", "k2")) is None and len(keys) == 3
    keys.served(("a", "k1"), "p1", "d1")  # served again elsewhere: the entry moves
    assert keys.get(("a", "k1")) == Served("p1", "d1")
    keys.check_integrity()
    keys.forget("d1")  # every key whose entry names it
    assert len(keys) == 0 and keys.workers() == set()
    keys.served(("a", "k1"), "p0", "d0")
    keys.forget("p0")
    assert keys.get(("a", "k1")) is None and keys.workers() == set()
    keys.check_integrity()
    with pytest.raises(ValueError):
        AffinityMap(capacity=0)


def test_the_map_holds_64k_keys_as_shipped():
    keys = AffinityMap()
    for i in range(65_537):
        keys.served(("a", str(i)), "p0", "d0")
    assert len(keys) == 65_536 and keys.get(("a", "0")) is None and keys.get(("a", "1")) == Served("p0", "d0")
    keys.check_integrity()


def _view(worker_id: str, queued: int = 0, free: int = 100, role: str = "prefill") -> WorkerView:
    return WorkerView(worker_id, role, free, 100, queued_prefill_tokens=queued, prefill_s_per_token=COST)


def test_the_key_s_worker_wins_unless_the_index_knows_a_deeper_hit_or_it_is_busy_past_the_slack():
    prompt = 1000  # its slack (4 prompts: 4 s) is past the floor
    idle = _view("p0")
    chosen = PrefillPlan("p0", False, 0, prompt * COST)  # the policy's pick: idle, nothing cached

    def prefer(plan, affine, cached=None, local=False, transfer_s=0.0, tokens=prompt):
        return prefer_affine(plan, affine, local, [idle, affine], cached or {}, tokens, COST, transfer_s)

    busy_within = _view("p1", queued=int(AFFINITY_SLACK_PROMPTS * prompt))
    plan = prefer(chosen, busy_within, transfer_s=0.5)
    assert plan == PrefillPlan("p1", False, 0, (5 * prompt) * COST + 0.5)  # its handoff counts in the prediction
    assert prefer(chosen, _view("p1", queued=int(AFFINITY_SLACK_PROMPTS * prompt) + 1)) is chosen  # busy past it
    deeper = PrefillPlan("p0", False, 32, (prompt - 32) * COST)  # the index knows 32 tokens on p0, 16 on p1
    assert prefer(deeper, _view("p1"), {"p0": 32, "p1": 16}) is deeper
    as_deep = prefer(deeper, _view("p1"), {"p0": 32, "p1": 32})
    assert as_deep.worker_id == "p1" and as_deep.cached_tokens == 32
    local = prefer(chosen, _view("d0", role="decode"), local=True, transfer_s=0.5)  # no handoff there
    assert local == PrefillPlan("d0", True, 0, prompt * COST)
    assert prefer_affine(chosen, None, False, [idle], {}, prompt, COST, 0.0) is chosen
    short = PrefillPlan("p0", False, 0, 10 * COST)  # a 10-token prompt: the floor is its slack
    floor_tokens = round(AFFINITY_SLACK_FLOOR_S / COST)
    assert prefer(short, _view("p1", queued=floor_tokens), tokens=10).worker_id == "p1"
    assert prefer(short, _view("p1", queued=floor_tokens + 1), tokens=10) is short


def test_the_key_s_decode_worker_is_taken_whenever_it_has_room():
    roomy, tight = _view("d0", free=90, role="decode"), _view("d1", free=10, role="decode")
    assert pick_decode([roomy, tight], 8, prefer="d1").worker_id == "d1"
    assert pick_decode([roomy, tight], 11, prefer="d1").worker_id == "d0"  # no room there: the most free
    assert pick_decode([roomy, tight], 8).worker_id == "d0"


CONVERSATIONS, TURNS = 6, 3
PARAMS = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def cluster(ray_session):
    config = load("disagg-2p2d.yaml")
    # Prompts prefilled on the prefill pool only: the worker a turn went to is the one that caches it.
    config = config.model_copy(update={"scheduler": config.scheduler.model_copy(update={"local_prefill": False})})
    cluster = Cluster.start(config)
    yield cluster
    cluster.shutdown()


def _turns(keyed: bool, cluster: Cluster, seed: int, own: int = 4) -> dict[int, list[str]]:
    """Each conversation's prefill worker, turn by turn. A turn of every conversation at once, in a new order each
    turn; turn t's prompt is the conversation's 10 tokens + `own` of its own (with 4: 14, less than a block of
    16; more are drawn anew each turn, so the prefix index still has nothing to go on)."""
    rng = random.Random(seed)
    heads = [[rng.randrange(10, 2000) for _ in range(10)] for _ in range(CONVERSATIONS)]
    tails = {(c, turn): [turn + 3] * 4 + [rng.randrange(10, 2000) for _ in range(own - 4)]
             for c in range(CONVERSATIONS) for turn in range(TURNS)}
    went: dict[int, list[str]] = {c: [] for c in range(CONVERSATIONS)}
    client = open_client(cluster)

    async def one(c: int, turn: int) -> str:
        request = client.request(heads[c] + tails[c, turn], PARAMS, cache_salt="tenant",
                                 affinity=f"conversation-{seed}-{c}" if keyed else None)
        submitted = await client.asubmit(request, timeout_s=60)
        async for _ in client.pump(submitted.stream):
            pass
        client.finish(submitted.stream)
        return submitted.route.prefill

    async def conversation_turns() -> None:
        for turn in range(TURNS):
            order = list(range(CONVERSATIONS))
            rng.shuffle(order)
            workers = await asyncio.wait_for(asyncio.gather(*(one(c, turn) for c in order)), 120)
            for c, worker in zip(order, workers):
                went[c].append(worker)
            await asyncio.to_thread(wait_until_reported, cluster)  # the next turn sees the workers as idle

    asyncio.run(conversation_turns())  # (the cluster's shutdown closes the client)
    return went


def test_a_conversation_s_turns_stay_on_one_prefill_worker_with_the_key_and_spread_without_it(cluster):
    keyed = _turns(True, cluster, seed=1)
    links = cluster.check_integrity()["scheduler"]["links"]
    assert all(len(set(workers)) == 1 for workers in keyed.values()), (keyed, links)  # each turn where the first went
    assert len({workers[0] for workers in keyed.values()}) == 2, keyed  # the keys' first turns spread over both
    # Without the key the predicted first token decides, and a turn's prompts must weigh in it: 14-token prompts
    # on this model cost less prefill than the measured links of the two prefill workers differ by (a faster
    # engine sent every one to the same worker), 300-token ones more.
    unkeyed = _turns(False, cluster, seed=2, own=290)
    assert sum(len(set(workers)) == 1 for workers in unkeyed.values()) < CONVERSATIONS, unkeyed  # load decides
    wait_until_idle(cluster)  # integrity, the affinity map's included
