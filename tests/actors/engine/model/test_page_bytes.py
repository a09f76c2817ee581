"""The KV bytes a token costs, per family, as the engine's caches hold them and a handoff ships them (whole
blocks of every layer): measured from the cache tensors and printed beside the formula from config.json.
MHA/GQA: K and V of every KV head, every layer; sliding-window (gpt-oss) and chunked (Llama 4) layers the
same (tandem keeps and ships every token of them: one block table for all layers); MLA (DeepSeek): one
latent row of kv_lora_rank + rope values a layer, shared by every head."""

from __future__ import annotations

import json

import pytest

from actors.engine.config import EngineConfig
from actors.engine.engine import Engine

FLOAT32 = 4


def _formula(config: dict) -> tuple[str, int]:
    layers = config["num_hidden_layers"]
    if config.get("kv_lora_rank"):
        width = config["kv_lora_rank"] + config["qk_rope_head_dim"]
        return f"MLA {layers} x ({config['kv_lora_rank']} + {config['qk_rope_head_dim']}) x 4", layers * width * FLOAT32
    heads = config.get("num_key_value_heads") or config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    return f"2 x {layers} x {heads} x {head_dim} x 4", 2 * layers * heads * head_dim * FLOAT32


@pytest.mark.parametrize("family", ["llama", "gpt-oss", "llama4", "deepseek-v3", "deepseek-v2"])
def test_a_tokens_kv_bytes_are_the_formulas(hf_models, family):
    config = json.loads((hf_models[family] / "config.json").read_text())
    engine = Engine(EngineConfig(model=str(hf_models[family]), block_size=8, num_kv_blocks=16, dtype="float32"))
    blocks = engine.kv_caches[0][0].shape[0]
    held = sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in engine.kv_caches)
    measured = held // (blocks * 8)
    how, expected = _formula(config)
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    k_dim, v_dim = ((config["qk_nope_head_dim"] + config["qk_rope_head_dim"], config["v_head_dim"])
                    if config.get("kv_lora_rank") else (head_dim, head_dim))
    per_head = config["num_hidden_layers"] * config["num_attention_heads"] * (k_dim + v_dim) * FLOAT32
    print(f"\n{family}: {measured} bytes a token held and shipped a block at a time; formula {how} = {expected}"
          f"; K and V of every query head would be {per_head}")
    assert measured == expected == engine.model_bytes_per_block // 8
