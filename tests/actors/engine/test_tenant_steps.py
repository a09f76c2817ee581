"""Tenants sharing an engine: a step shared by several tenants is cut to the tokens the measured step
cost allows (`engine.tenant_slowdown`), tenants take turns, nobody starves, outputs are unchanged."""

from __future__ import annotations

from collections import Counter

import pytest

from actors.engine.config import EngineConfig
from actors.engine.engine import Engine
from actors.engine.step_cost import StepCost
from actors.protocol.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def _engine(model_dir, **kw) -> Engine:
    return Engine(EngineConfig(model=str(model_dir), block_size=8, num_kv_blocks=256, **kw))


def _slow_batches(engine: Engine) -> None:
    """What a CPU worker measures: a step's seconds grow with its tokens (0.5 ms + 1 ms per token), so a
    step may hold 2 tokens at most to stay within 2x a one-token step. Frozen: this run's own (flat,
    tiny-model) timings must not change the curve under test."""
    for tokens in (1, 4, 16, 64):
        engine.batcher.cost.observe(tokens, 0.001 * (0.5 + tokens))
    engine.batcher.cost.observe = lambda tokens, seconds: None
    assert engine.batcher.cost.max_tokens(2.0, 2048) == 2


def _drive(engine: Engine) -> list[tuple[int, set, Counter]]:
    """Step to the end; per step: tokens computed, tenants with work before it, tokens out per request."""
    steps = []
    while engine.has_work():
        tenants = {s.cache_salt for s in engine.batcher.running} | {s.cache_salt for s in engine.batcher.waiting}
        out = Counter(o.request_id for o in engine.step() for _ in o.new_token_ids)
        steps.append((engine.last_step_tokens, tenants, out))
    engine.check_integrity()
    assert engine.num_used_blocks == 0
    return steps


def test_step_cost_cap_follows_the_measured_curve():
    cost = StepCost()
    assert cost.max_tokens(2.0, 512) == 512  # nothing measured: no cap
    for _ in range(3):
        cost.observe(1, 0.003)
        cost.observe(33, 0.013)
    assert cost.max_tokens(2.0, 512) == 10  # 3 ms + 0.3125 ms/token: 10 tokens take 5.8 ms
    flat = StepCost()  # a GPU-like curve: 64 sequences cost 1/8 more than one
    for _ in range(3):
        flat.observe(1, 0.008)
        flat.observe(64, 0.009)
    assert flat.max_tokens(2.0, 256) == 256


def test_a_shared_step_is_capped_and_the_small_tenant_gets_a_token_every_step(hf_models):
    engine = _engine(hf_models["llama"])
    _slow_batches(engine)
    for i in range(6):  # tenant a: six requests, queued first
        engine.add_request(f"a{i}", list(range(10 + i, 14 + i)), GREEDY, cache_salt="a")
    engine.add_request("b0", list(range(50, 54)), GREEDY, cache_salt="b")
    steps = _drive(engine)
    shared = [tokens for tokens, tenants, _ in steps if len(tenants) > 1]
    assert shared and max(shared) <= 2, steps
    assert engine.batcher.capped_steps == len(shared)
    b_steps = [i for i, (_, _, out) in enumerate(steps) if out["b0"]]
    assert len(b_steps) == GREEDY.max_tokens
    assert b_steps == list(range(b_steps[0], b_steps[0] + len(b_steps))), f"b0 missed a step: {b_steps}"
    a_last = max(i for i, (_, _, out) in enumerate(steps) if any(r.startswith("a") for r in out))
    assert b_steps[-1] < a_last, "b0 waited for tenant a's requests to finish"


def test_running_sequences_of_the_big_tenant_take_turns(hf_models):
    """Six of tenant a's sequences running, one slot for them per step: each gets tokens while b runs."""
    engine = _engine(hf_models["llama"])
    for i in range(6):
        engine.add_request(f"a{i}", list(range(10 + i, 14 + i)), GREEDY, cache_salt="a")
    engine.step()  # all six admitted and prefilled in one uncapped step (one tenant)
    _slow_batches(engine)
    engine.add_request("b0", list(range(50, 54)), GREEDY, cache_salt="b")
    steps = _drive(engine)
    b_done = max(i for i, (_, _, out) in enumerate(steps) if out["b0"])
    a_turns = Counter(r for _, _, out in steps[: b_done + 1] for r in out if r.startswith("a"))
    assert set(a_turns) == {f"a{i}" for i in range(6)} and max(a_turns.values()) - min(a_turns.values()) <= 1, a_turns


def test_one_tenant_alone_is_never_capped(hf_models):
    engine = _engine(hf_models["llama"])
    _slow_batches(engine)
    for i in range(6):
        engine.add_request(f"a{i}", list(range(10 + i, 14 + i)), GREEDY, cache_salt="a")
    steps = _drive(engine)
    assert max(tokens for tokens, _, _ in steps) == 24 and engine.batcher.capped_steps == 0


@pytest.mark.parametrize("slowdown", [2.0, None], ids=["capped", "uncapped"])
def test_tenant_turns_do_not_change_outputs(hf_models, slowdown):
    prompts = [list(range(7 * i, 7 * i + 5 + i)) for i in range(8)]
    reference = _engine(hf_models["llama"], tenant_slowdown=None)
    expected = [r.outputs[0].token_ids for r in reference.generate(prompts, GREEDY)]
    engine = _engine(hf_models["llama"], tenant_slowdown=slowdown)
    if slowdown:
        _slow_batches(engine)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, GREEDY, cache_salt="ab"[i % 2])
    tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    while engine.has_work():
        for o in engine.step():
            tokens[o.request_id].extend(o.new_token_ids)
    assert [tokens[f"r{i}"] for i in range(len(prompts))] == expected
    engine.check_integrity()
