"""Acceptance 2: the same greedy outputs whatever the batching, chunking, caching or preemption."""

from __future__ import annotations

import pytest
import torch

from actors.engine.config import EngineConfig
from actors.engine.engine import Engine
from actors.protocol.sampling_params import SamplingParams

BLOCK = 8


def _requests(n=16, shared_prefix: list[int] | None = None):
    g = torch.Generator().manual_seed(7)
    prompts, params = [], []
    for i in range(n):
        length = 3 + (i * 11) % 58  # 3..60 tokens, mixed
        ids = torch.randint(0, 512, (length,), generator=g).tolist()
        prompts.append((shared_prefix or []) + ids)
        params.append(SamplingParams(temperature=0.0, max_tokens=6 + (i * 5) % 20, ignore_eos=True))
    return prompts, params


def _engine(model_dir, **kw) -> Engine:
    kw.setdefault("num_kv_blocks", 256)
    return Engine(EngineConfig(model=str(model_dir), block_size=BLOCK, **kw))


def _run(engine, prompts, params):
    out = [r.outputs[0].token_ids for r in engine.generate(prompts, params)]
    engine.check_integrity()
    assert engine.num_used_blocks == 0
    return out


@pytest.fixture(scope="module")
def alone(hf_models):
    """Reference: every request alone in an engine with no prefix cache."""
    prompts, params = _requests()
    engine = _engine(hf_models["llama"], enable_prefix_caching=False)
    return [_run(engine, [p], [s])[0] for p, s in zip(prompts, params)]


@pytest.mark.parametrize(
    "settings",
    [
        dict(),  # one batch of 16, whole prompts in one step
        dict(max_num_batched_tokens=16),  # chunked prefill: prompts split into <= 16-token chunks
        dict(enable_chunked_prefill=False, max_num_batched_tokens=64),
        dict(max_num_seqs=5),  # requests join and leave the running batch at every step
    ],
    ids=["batch16", "chunked16", "no-chunking", "max-seqs-5"],
)
def test_batched_matches_alone(hf_models, alone, settings):
    prompts, params = _requests()
    engine = _engine(hf_models["llama"], **settings)
    assert _run(engine, prompts, params) == alone


def test_prefix_cache_hits_do_not_change_outputs(hf_models):
    prefix = torch.randint(0, 512, (29,), generator=torch.Generator().manual_seed(3)).tolist()
    prompts, params = _requests(shared_prefix=prefix)
    reference = _run(_engine(hf_models["llama"], enable_prefix_caching=False), prompts, params)
    engine = _engine(hf_models["llama"])
    first = engine.generate(prompts, params)
    second = engine.generate(prompts, params)  # every full prompt block is cached now
    assert [r.outputs[0].token_ids for r in first] == reference
    assert [r.outputs[0].token_ids for r in second] == reference
    for prompt, r in zip(prompts, second):
        full_blocks = (len(prompt) - 1) // BLOCK * BLOCK  # the last token is always recomputed
        assert r.num_cached_tokens == full_blocks
    engine.check_integrity()
    assert engine.num_used_blocks == 0


def test_preemption_does_not_change_outputs(hf_models, alone):
    prompts, params = _requests()
    # 24 blocks of 8 slots hold ~3 of these requests: running ones must be preempted and recomputed.
    engine = _engine(hf_models["llama"], num_kv_blocks=24)
    assert _run(engine, prompts, params) == alone
    assert engine.batcher.num_preemptions > 0


def test_a_prompt_cap_bounds_every_step_and_changes_no_output(hf_models, alone):
    """A decode worker's cap (`Batcher.max_prefill_tokens`): no step computes more prompt tokens than it,
    decodes and adoptions do not count against it, and the greedy outputs are those of each request alone."""
    prompts, params = _requests()
    engine = _engine(hf_models["llama"])
    engine.batcher.max_prefill_tokens = 10
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        engine.add_request(i, prompt, p)
    outputs: dict[int, list[int]] = {i: [] for i in range(len(prompts))}
    shapes = []
    while engine.has_unfinished():
        for out in engine.step():
            outputs[out.request_id] += out.new_token_ids
        shapes.append(engine.last_step_shape)
    assert [outputs[i] for i in range(len(prompts))] == alone
    assert max(s.prefill_tokens for s in shapes) == 10  # it was reached, never passed
    assert any(s.prefill_tokens == 10 and s.decode_seqs for s in shapes), "decodes ran beside capped chunks"
    engine.check_integrity()
    assert engine.num_used_blocks == 0


def test_chunked_prefill_interleaves_with_decode(hf_models):
    """A long prompt is split into chunks while a running request keeps decoding every step."""
    engine = _engine(hf_models["llama"], max_num_batched_tokens=16)
    engine.add_request("short", [1, 2, 3], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    engine.step()  # "short" is prefilled and now decodes
    engine.add_request("long", list(range(100, 160)), SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
    per_step = []
    while engine.has_unfinished():
        per_step.append({(o.request_id, len(o.new_token_ids)) for o in engine.step()})
    # While "long" (60 tokens) is prefilled in 15-token chunks, "short" gets a token every step.
    assert all(("short", 1) in step for step in per_step[:4])
    assert all(("long", 1) not in step for step in per_step[:3])
    assert ("long", 1) in per_step[3]
    engine.check_integrity()
    assert engine.num_used_blocks == 0
