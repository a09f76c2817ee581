"""Acceptance 1: parity with Hugging Face transformers on the same weights, float32."""

from __future__ import annotations

import pytest
import torch
import transformers

from actors.attention import build_attention_batch
from actors.engine import Engine
from actors.engine_config import EngineConfig
from actors.models.loader import load_model
from actors.sampling_params import SamplingParams

FAMILIES = ["llama", "qwen2", "mistral"]
BLOCK_SIZE = 8  # does not divide the prompt lengths below


def _hf(model_dir):
    return transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def _prompt(n: int, vocab: int, seed: int) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("family", FAMILIES)
def test_prefill_logits_match_transformers(hf_models, family):
    model_dir = hf_models[family]
    ours = load_model(model_dir)
    vocab = ours.cfg.vocab_size
    ids = _prompt(45, vocab, seed=1)
    with torch.no_grad():
        ref = _hf(model_dir)(torch.tensor([ids])).logits[0]
    blocks = -(-len(ids) // BLOCK_SIZE)
    shape = (blocks + 1, BLOCK_SIZE, ours.cfg.num_kv_heads, ours.cfg.head_dim)
    kv = [(torch.zeros(shape), torch.zeros(shape)) for _ in range(ours.cfg.num_layers)]
    # Blocks in reverse order: the block table, not physical order, must decide what is read.
    table = list(range(blocks, 0, -1))
    # Two chunks, so the second one reads the first one's K/V back through the paged cache.
    logits = []
    for start, end in [(0, 30), (30, len(ids))]:
        batch = build_attention_batch([end - start], [start], [table], BLOCK_SIZE, ours.sliding_window, torch.device("cpu"))
        with torch.inference_mode():
            logits.append(ours(torch.tensor(ids[start:end]), batch, kv, torch.arange(end - start)))
    got = torch.cat(logits)
    assert got.shape == ref.shape
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_continuation_matches_transformers_generate(hf_models, family):
    model_dir = hf_models[family]
    prompts = [_prompt(n, 300, seed=n) for n in (5, 19, 37)]
    engine = Engine(EngineConfig(model=str(model_dir), block_size=BLOCK_SIZE, num_kv_blocks=64))
    results = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
    hf = _hf(model_dir)
    for prompt, result in zip(prompts, results):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=40, min_new_tokens=40)
        assert result.outputs[0].token_ids == ref[0, len(prompt):].tolist()
        assert result.outputs[0].finish_reason == "length"
    engine.check_integrity()
    assert engine.num_used_blocks == 0
