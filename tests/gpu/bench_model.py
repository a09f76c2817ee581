"""A random Llama checkpoint of a realistic size, built from a config on the device (no download)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

# ~1.1B parameters (Llama 3.2 1B's shape with a 32k vocabulary): 2.2 GB of weights in bfloat16.
BENCH_CONFIGS = {
    "gpu": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                num_key_value_heads=8, vocab_size=32000),
    "cpu": dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=1024),  # dry runs only
}


def write_random_checkpoint(out: Path, shape: dict, device: torch.device, seed: int = 0) -> Path:
    """A Hugging Face style directory (config.json + model.safetensors) with N(0, 0.02) bf16 weights."""
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "max_position_embeddings": 4096,
              "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
              **shape}
    h, inter, vocab = shape["hidden_size"], shape["intermediate_size"], shape["vocab_size"]
    head_dim = h // shape["num_attention_heads"]
    kv = shape["num_key_value_heads"] * head_dim
    g = torch.Generator(device=device).manual_seed(seed)

    def normal(*size):
        return (torch.randn(*size, generator=g, device=device, dtype=torch.bfloat16) * 0.02).cpu()

    def ones(n):
        return torch.ones(n, dtype=torch.bfloat16)

    weights = {"model.embed_tokens.weight": normal(vocab, h), "model.norm.weight": ones(h),
               "lm_head.weight": normal(vocab, h)}
    for i in range(shape["num_hidden_layers"]):
        p = f"model.layers.{i}."
        weights |= {
            p + "self_attn.q_proj.weight": normal(h, h), p + "self_attn.k_proj.weight": normal(kv, h),
            p + "self_attn.v_proj.weight": normal(kv, h), p + "self_attn.o_proj.weight": normal(h, h),
            p + "mlp.gate_proj.weight": normal(inter, h), p + "mlp.up_proj.weight": normal(inter, h),
            p + "mlp.down_proj.weight": normal(h, inter),
            p + "input_layernorm.weight": ones(h), p + "post_attention_layernorm.weight": ones(h),
        }
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out
