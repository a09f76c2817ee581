"""Tensor parallelism inside a worker, on CPU (gloo): the sharded model's prefill logits equal the whole
model's (rtol 1e-4), and a TP engine's greedy tokens equal a one-process engine's, for split KV heads,
replicated KV heads (more ranks than KV heads), a vocabulary that does not split evenly, biases,
Phi-3's fused checkpoint weights, Gemma's caps, experts (Llama 4's with a shared expert and
checkpoint-transposed weights) and DeepSeek's latent attention."""

from __future__ import annotations

import time

import pytest
import torch

from actors.engine.config import EngineConfig
from actors.engine.engine import Engine
from actors.engine.model.loader import load_model
from actors.engine.model.parallel import DistComm, TPShard
from actors.protocol.sampling_params import SamplingParams
from experiments.tp_ranks import run_ranks
from tests.helpers.models import make_hf_model, paged_prefill_logits

BLOCK_SIZE = 8
# (family, overrides, TP size): 4 KV heads split in 2; 2 KV heads over 4 ranks (replicated); 1 KV head
# (Qwen2, qkv bias, tied) over 2; a 401-token vocabulary over 2; Phi-3 over 4; Gemma 2, Qwen3-MoE, Llama 4 and
# gpt-oss (sinks split by query head, expert biases split by width, o's and down's biases added once) over 2.
LAYOUTS = [
    ("llama", {"num_key_value_heads": 4}, 2),
    ("llama", {}, 4),
    ("qwen2", {}, 2),
    ("llama", {"vocab_size": 401}, 2),
    ("phi3", {}, 4),
    ("gemma2", {}, 2),
    ("qwen3-moe", {}, 2),
    ("llama4", {}, 2),
    ("gpt-oss", {}, 2),
    ("deepseek-v3", {}, 2),  # heads, experts and the shared expert split; the latent on both ranks
    ("deepseek-v2", {}, 2),
]
IDS = [f"{f}-{'-'.join(f'{k}{v}' for k, v in o.items()) or 'base'}-tp{n}" for f, o, n in LAYOUTS]


def _params(indices: list[int]) -> list:
    """Those layouts as test cases; the 4-rank ones (4 processes on this 2-core box) are the slow tier's."""
    return [pytest.param(*LAYOUTS[i], id=IDS[i], marks=[pytest.mark.slow] if LAYOUTS[i][2] > 2 else [])
            for i in indices]


def _prompt(n: int, vocab: int, seed: int) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _sharded_prefill(rank: int, size: int, model_dir: str, ids: list[int]) -> torch.Tensor:
    shard = TPShard(rank, size)
    model = load_model(model_dir, shard=shard)
    model.attach(DistComm(shard))
    return paged_prefill_logits(model, ids)


def _tp_engine(rank: int, size: int, model_dir: str, prompts: list[list[int]], n: int):
    comm = DistComm(TPShard(rank, size))
    config = EngineConfig(model=model_dir, block_size=BLOCK_SIZE, num_kv_blocks=64, max_num_batched_tokens=24)
    engine = Engine(config, comm)
    if rank != 0:
        engine.runner.follow()
        return None
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, n=n)
    results = engine.generate(prompts, params)
    engine.runner.stop_followers()
    engine.check_integrity()
    return [[o.token_ids for o in r.outputs] for r in results], engine.num_used_blocks


@pytest.mark.parametrize("family, overrides, size", _params(list(range(len(LAYOUTS)))))
def test_sharded_prefill_logits_match_the_whole_model(tmp_path, family, overrides, size):
    model_dir = make_hf_model(tmp_path / "m", family, seed=3, **overrides)
    whole = load_model(model_dir)
    ids = _prompt(45, whole.cfg.vocab_size, seed=1)
    ref = paged_prefill_logits(whole, ids)
    got = run_ranks(size, _sharded_prefill, str(model_dir), ids)
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())


@pytest.mark.parametrize("family, overrides, size", _params([0, 1, 6, 7]))
def test_tp_engine_greedy_equals_one_process(tmp_path, family, overrides, size):
    """Chunked prefill (24-token budget), several sequences per step, and n=2 forks (a copied block)."""
    model_dir = make_hf_model(tmp_path / "m", family, seed=3, **overrides)
    prompts = [_prompt(n, 300, seed=n) for n in (5, 19, 37, 50)]
    engine = Engine(EngineConfig(model=str(model_dir), block_size=BLOCK_SIZE, num_kv_blocks=64, max_num_batched_tokens=24))
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, n=2)
    expected = [[o.token_ids for o in r.outputs] for r in engine.generate(prompts, params)]
    got, used = run_ranks(size, _tp_engine, str(model_dir), prompts, 2)
    assert got == expected
    assert used == 0


def _idle_then_generate(rank: int, size: int, model_dir: str, idle_s: float, keep_waiting: bool):
    engine = Engine(EngineConfig(model=model_dir, block_size=BLOCK_SIZE, num_kv_blocks=16), DistComm(TPShard(rank, size)))
    if rank != 0:
        engine.runner.follow()
        return None
    deadline = time.monotonic() + idle_s
    while time.monotonic() < deadline:  # as a worker's engine thread heartbeats with nothing to run
        if keep_waiting:
            engine.runner.keep_followers_waiting(every_s=0.5)
        time.sleep(0.05)
    (result,) = engine.generate([[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    engine.runner.stop_followers()
    return result.outputs[0].token_ids


def test_followers_outlast_an_idle_leader(hf_models):
    """A follower waits for the next step in a collective with a timeout; a rank 0 idle for longer than
    that keeps it waiting with empty plans, and the next step runs."""
    tokens = run_ranks(2, _idle_then_generate, str(hf_models["llama"]), 5.0, True, collective_timeout_s=2.0)
    assert len(tokens) == 4


def test_layouts_that_do_not_split_are_refused(hf_models):
    with pytest.raises(ValueError, match="tensor_parallel_size=3 does not divide num_attention_heads=4"):
        load_model(hf_models["llama"], shard=TPShard(0, 3))
