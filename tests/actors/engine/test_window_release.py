"""A model whose every layer has a sliding window holds only the blocks its window can still reach; one
with a full-attention layer holds them all. Either way the tokens are transformers' own."""

from __future__ import annotations

import torch
import transformers

from actors.engine.config import EngineConfig
from actors.engine.engine import Engine
from actors.protocol.sampling_params import SamplingParams

BLOCK_SIZE = 8


def _run(model_dir, prompt: list[int], max_tokens: int, **config) -> tuple[list[int], int]:
    """Greedy tokens and the most blocks the engine held at once."""
    engine = Engine(EngineConfig(model=str(model_dir), block_size=BLOCK_SIZE, num_kv_blocks=64, **config))
    engine.add_request("r", prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    tokens, peak = [], 0
    while engine.has_unfinished():
        for out in engine.step():
            tokens.extend(out.new_token_ids)
        peak = max(peak, engine.num_used_blocks)
        engine.check_integrity()
    assert engine.num_used_blocks == 0
    return tokens, peak


def _reference(model_dir, prompt: list[int], max_tokens: int) -> list[int]:
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=max_tokens, min_new_tokens=max_tokens)
    return out[0, len(prompt):].tolist()


def _prompt(n: int) -> list[int]:
    return torch.randint(0, 300, (n,), generator=torch.Generator().manual_seed(n)).tolist()


def test_an_all_sliding_model_holds_only_its_window(hf_models):
    model_dir = hf_models["mistral"]  # window 24 in every layer
    prompt = _prompt(37)
    for caching in (True, False):
        tokens, peak = _run(model_dir, prompt, 120, enable_prefix_caching=caching)
        assert tokens == _reference(model_dir, prompt, 120)
        # 157 tokens would fill 20 blocks; the window (24 tokens) spans at most 4 blocks, plus the one
        # being written and the last computed prompt chunk's.
        assert peak <= 24 // BLOCK_SIZE + 2, (caching, peak)


def test_a_long_prompt_in_chunks_releases_between_chunks(hf_models):
    model_dir = hf_models["mistral"]
    prompt = _prompt(150)
    tokens, peak = _run(model_dir, prompt, 8, max_num_batched_tokens=32, enable_chunked_prefill=True)
    assert tokens == _reference(model_dir, prompt, 8)
    assert peak < 150 // BLOCK_SIZE


def test_a_model_with_a_full_attention_layer_keeps_every_block(hf_models):
    model_dir = hf_models["gemma2"]  # sliding and full layers alternate
    tokens, peak = _run(model_dir, _prompt(37), 60)
    assert peak == -(-(37 + 60 - 1) // BLOCK_SIZE)
