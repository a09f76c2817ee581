"""Llama 4 text beyond the parity tests of every family (test_model_parity.py): its decodes on the
reference SDPA path (chunked decode masks built per step), and the configs tandem refuses."""

from __future__ import annotations

import json

import pytest
import torch
import transformers

from actors.engine.config import EngineConfig
from actors.engine.engine import Engine
from actors.engine.model.llama4 import Llama4Config, Llama4Model
from actors.protocol.sampling_params import SamplingParams


def test_sdpa_decodes_keep_to_the_chunks_as_transformers_does(hf_models):
    model_dir = hf_models["llama4"]
    # 7 and twice 29 tokens (the two prefill side by side in one call, chunk by chunk); decodes cross edges of 8.
    prompts = [list(range(3, 10)), list(range(40, 69)), list(range(100, 129))]
    engine = Engine(EngineConfig(model=str(model_dir), block_size=8, num_kv_blocks=32, attention_backend="sdpa"))
    assert engine.runner.attention.name == "sdpa"
    results = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    for prompt, result in zip(prompts, results):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=20, min_new_tokens=20)
        assert result.outputs[0].token_ids == ref[0, len(prompt):].tolist()
    engine.check_integrity()


def test_the_layer_kinds_come_from_the_config(hf_models):
    cfg = Llama4Config.from_hf(json.loads((hf_models["llama4"] / "config.json").read_text()))
    assert cfg.rope_layers == (True, False, True, False) and cfg.attention_chunk_size == 8
    assert cfg.dense_layers == (0, 2) and (cfg.intermediate_size, cfg.expert_intermediate_size) == (96, 32)
    model = Llama4Model(cfg)
    assert [layer.attn.layer_attention.chunk for layer in model.layers] == [8, None, 8, None]
    assert len(model.layer_attentions()) == 2


def test_what_tandem_refuses_is_named(hf_models):
    hf = json.loads((hf_models["llama4"] / "config.json").read_text())
    with pytest.raises(ValueError, match="attention_bias"):
        Llama4Config.from_hf({**hf, "attention_bias": True})
    with pytest.raises(ValueError, match="chunked_attention layers need attention_chunk_size"):
        Llama4Config.from_hf({**hf, "attention_chunk_size": None})
