"""Overflow prefill on a live 1P:1D cluster, with the shipped settings (scheduler.local_prefill_overflow_s,
local_prefill_max_tokens): once the prefill worker is measured slow enough that a long prompt is predicted
past the overflow time there, the decode worker prefills it itself, at most local_prefill_max_tokens of it a
step, and the answer is the engine's own greedy answer. Once a second tenant is served, a long prompt
stays on the prefill worker however slow it is predicted there."""

from __future__ import annotations

import ray

from actors.engine.engine import Engine
from actors.protocol.sampling_params import SamplingParams
from cluster.control.lifecycle.launch import Cluster
from cluster.frontend.open_client import open_client
from tests.helpers.cluster import load, wait_until_idle

SLOW_STEP_S = 3.0  # one prefill step this long: the worker measures ~2 ms a prompt token


def _prompt(seed: int, n: int = 1500) -> list[int]:
    return [(seed * 131 + 7 * i) % 2000 + 3 for i in range(n)]


def test_a_long_prompt_overflows_onto_the_decode_worker_in_capped_steps(ray_session):
    config = load("local.yaml")
    cap = config.scheduler.local_prefill_max_tokens
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    # The first prompt, predicted at the scheduler's unmeasured guess, stays under the overflow time: it goes to
    # the prefill worker, which measures itself slow on it.
    first, second, third = _prompt(1, 1000), _prompt(2), _prompt(3)
    short = _prompt(4, 20)
    assert len(first) * config.scheduler.prefill_s_per_token < config.scheduler.local_prefill_overflow_s, "precondition"
    assert len(second) > cap, "precondition: without overflow this prompt is never prefilled locally"
    engine = Engine(config.engine_config())
    expected = [r.outputs[0].token_ids for r in engine.generate([first, second, third, short], params)]
    cluster = Cluster.start(config)
    try:
        client = open_client(cluster)
        ray.get(cluster.workers["prefill-0"].inject_fault.remote("slow_step", SLOW_STEP_S), timeout=30)
        assert client.generate([first], params, timeout_s=120)[0][0].token_ids == expected[0]
        state = wait_until_idle(cluster)
        assert state["scheduler"]["counters"]["local_prefills"] == 0, "the first prompt went to the prefill worker"
        logged, _ = ray.get(cluster.workers["decode-0"].step_log.remote(0), timeout=30)

        assert client.generate([second], params, timeout_s=120)[0][0].token_ids == expected[1]
        state = wait_until_idle(cluster)
        assert state["scheduler"]["counters"]["local_prefills"] == 1, "the second prompt overflowed"
        _, steps = ray.get(cluster.workers["decode-0"].step_log.remote(logged), timeout=30)
        prompt_steps = [s.prefill_tokens for s in steps if s.prefill_tokens]
        assert sum(prompt_steps) == len(second) and max(prompt_steps) == cap, prompt_steps

        logged, _ = ray.get(cluster.workers["decode-0"].step_log.remote(0), timeout=30)
        assert client.generate([short], params, cache_salt="b", timeout_s=120)[0][0].token_ids == expected[3]
        assert client.generate([third], params, timeout_s=120)[0][0].token_ids == expected[2]
        wait_until_idle(cluster)
        _, steps = ray.get(cluster.workers["decode-0"].step_log.remote(logged), timeout=30)
        assert sum(s.prefill_tokens for s in steps) <= len(short), "with two tenants the long prompt stayed remote"
    finally:
        cluster.shutdown()
