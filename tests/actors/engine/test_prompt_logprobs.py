"""Prompt logprobs in the engine: computed during (chunked) prefill, equal to transformers' log-softmax
of the whole prompt's logits (float32), the same with a prefix-cache hit available (the scoring
sequence recomputes instead), after a preemption, with n > 1, and on a tensor-parallel engine (the
scored rows travel in the step plan)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from actors.engine.config import EngineConfig
from actors.engine.engine import Engine
from actors.engine.model.parallel import DistComm, TPShard
from actors.protocol.sampling_params import SamplingParams
from experiments.tp_ranks import run_ranks
from tests.helpers.models import make_hf_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(make_hf_model(tmp_path_factory.mktemp("m"), "llama", seed=2, num_key_value_heads=4))


def _reference(model_dir: str, prompt: list[int]) -> torch.Tensor:
    """transformers' logprobs of the whole prompt: row i scores token i + 1."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([prompt])).logits[0].float().log_softmax(-1)


def _engine(model_dir: str, **kw) -> Engine:
    return Engine(EngineConfig(model=model_dir, block_size=8, num_kv_blocks=64, max_num_batched_tokens=16, **kw))


def _check(result, prompt, ref, k):
    entries = result.prompt_logprobs
    assert entries[0] is None and len(entries) == len(prompt)
    for i, e in enumerate(entries[1:], start=1):
        assert e.token_id == prompt[i]
        assert e.logprob == pytest.approx(ref[i - 1, prompt[i]].item(), abs=1e-4)
        assert len(e.top) == k
        assert [t for t, _ in e.top] == ref[i - 1].topk(k).indices.tolist()
        assert e.rank == int((ref[i - 1] > ref[i - 1, prompt[i]]).sum()) + 1


PROMPT = list(range(20, 61))  # 41 tokens: three 16-token chunks, the last one short


def test_chunked_prefill_scores_match_transformers_with_and_without_a_cache_hit(model_dir):
    ref = _reference(model_dir, PROMPT)
    engine = _engine(model_dir)
    plain = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    scored = dataclasses.replace(plain, prompt_logprobs=3)
    (warm,) = engine.generate([PROMPT], plain)  # fills the prefix cache
    assert warm.prompt_logprobs is None
    (hit_available,) = engine.generate([PROMPT], scored)
    assert hit_available.num_cached_tokens == 0  # it recomputed: cached positions' logits were never kept
    _check(hit_available, PROMPT, ref, 3)
    (again,) = engine.generate([PROMPT], plain)
    assert again.num_cached_tokens == 40  # the scoring run's blocks were cached for others
    assert again.outputs[0].token_ids == warm.outputs[0].token_ids == hit_available.outputs[0].token_ids
    engine.check_integrity()


def test_n2_and_a_preempted_neighbour(model_dir):
    """Two samples share one prompt's scores; a KV pool so small that sequences get preempted and
    recompute does not score a prompt token twice."""
    ref = _reference(model_dir, PROMPT)
    engine = _engine(model_dir, enable_prefix_caching=False)
    engine = Engine(dataclasses.replace(engine.config, num_kv_blocks=12))
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, prompt_logprobs=0, n=2)
    other = list(range(100, 141))
    results = engine.generate([PROMPT, other], params)
    _check(results[0], PROMPT, ref, 0)
    _check(results[1], other, _reference(model_dir, other), 0)
    assert engine.load().preemptions > 0
    engine.check_integrity()


def _tp_scores(rank: int, size: int, model_dir: str, prompt: list[int]):
    engine = Engine(EngineConfig(model=model_dir, block_size=8, num_kv_blocks=64, max_num_batched_tokens=16),
                    DistComm(TPShard(rank, size)))
    if rank != 0:
        engine.runner.follow()
        return None
    (result,) = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=2))
    engine.runner.stop_followers()
    return [(e.token_id, e.logprob, e.top) for e in result.prompt_logprobs[1:]]


def test_tensor_parallel_engine_scores_the_same(model_dir):
    (single,) = _engine(model_dir).generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=2))
    got = run_ranks(2, _tp_scores, model_dir, PROMPT)
    assert [t for t, _, _ in got] == PROMPT[1:]
    assert [lp for _, lp, _ in got] == pytest.approx([e.logprob for e in single.prompt_logprobs[1:]], abs=1e-4)
    assert [[t for t, _ in top] for _, _, top in got] == [[t for t, _ in e.top] for e in single.prompt_logprobs[1:]]
