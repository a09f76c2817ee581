"""Load a Hugging Face checkpoint directory (config.json + *.safetensors, sharded or not).

Checkpoint names are remapped here onto the fused layout of `actors.engine.model.llama`.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors import safe_open

from actors.engine.model.gemma import Gemma2Config, Gemma2Model
from actors.engine.model.llama import LlamaConfig, LlamaModel, RotaryEmbedding

# Qwen2 is the Llama layout with a qkv bias, Qwen3 with q/k norms: LlamaConfig.from_hf reads which from the config.
SUPPORTED_ARCHITECTURES = {"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                           "Gemma2ForCausalLM"}
_BY_MODEL_TYPE = {a.removesuffix("ForCausalLM").lower(): a for a in SUPPORTED_ARCHITECTURES}
# Families with a decoder of their own (any other is the Llama decoder).
_DECODERS = {"Gemma2ForCausalLM": (Gemma2Config, Gemma2Model)}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")
_RENAMES = {
    "self_attn.o_proj.weight": "attn.o.weight",
    "mlp.down_proj.weight": "mlp.down.weight",
    "input_layernorm.weight": "input_norm.weight",
    "post_attention_layernorm.weight": "post_attn_norm.weight",
    "self_attn.q_norm.weight": "attn.q_norm.weight",  # Qwen3
    "self_attn.k_norm.weight": "attn.k_norm.weight",
    "pre_feedforward_layernorm.weight": "pre_ffn_norm.weight",  # Gemma 2
    "post_feedforward_layernorm.weight": "post_ffn_norm.weight",
}
# Parts concatenated (in this order) into one fused parameter.
_FUSED = {
    "attn.qkv.weight": ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
    "attn.qkv.bias": ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"),
    "mlp.gate_up.weight": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
}


def read_hf_config(model_dir: str | Path) -> dict:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise ValueError(f"model directory {model_dir} has no config.json (expected a Hugging Face checkpoint)")
    hf = json.loads(path.read_text())
    if not hf.get("architectures") and hf.get("model_type") in _BY_MODEL_TYPE:
        # Some exported checkpoints name only the model type.
        hf = {**hf, "architectures": [_BY_MODEL_TYPE[hf["model_type"]]]}
    archs = set(hf.get("architectures") or [])
    if not archs & SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"{path}: architectures {sorted(archs)} not supported; tandem runs {sorted(SUPPORTED_ARCHITECTURES)}"
        )
    return hf


def load_model(model_dir: str | Path, dtype: str = "float32", device: str | torch.device = "cpu") -> LlamaModel:
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} not supported; choose one of {sorted(DTYPES)}")
    hf = read_hf_config(model_dir)
    config_cls, model_cls = next((_DECODERS[a] for a in hf.get("architectures") or [] if a in _DECODERS),
                                 (LlamaConfig, LlamaModel))
    cfg = config_cls.from_hf(hf)
    checkpoint = _read_checkpoint(Path(model_dir))
    state = _remap(checkpoint, cfg)
    with torch.device("meta"):
        model = model_cls(cfg)
    expected = {name for name in model.state_dict() if not (cfg.tie_word_embeddings and name == "lm_head.weight")}
    missing, unexpected = expected - state.keys(), state.keys() - expected
    if missing or unexpected:
        raise ValueError(f"checkpoint in {model_dir} does not match the model: missing {sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]}")
    target = DTYPES[dtype]
    state = {name: t.to(device=device, dtype=target) for name, t in state.items()}
    model.load_state_dict(state, strict=False, assign=True)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    model.rope = RotaryEmbedding(cfg).to(device)  # buffers were on meta; cos/sin stay float32
    return model.eval()


def _read_checkpoint(model_dir: Path) -> dict[str, torch.Tensor]:
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ValueError(f"model directory {model_dir} has no *.safetensors weights")
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                tensors[name] = f.get_tensor(name)
    return tensors


def _remap(checkpoint: dict[str, torch.Tensor], cfg: LlamaConfig) -> dict[str, torch.Tensor]:
    state: dict[str, torch.Tensor] = {}
    per_layer: dict[int, dict[str, torch.Tensor]] = {}
    for name, tensor in checkpoint.items():
        if name.endswith("rotary_emb.inv_freq"):
            continue
        if name == "model.embed_tokens.weight":
            state["embed_tokens.weight"] = tensor
        elif name == "model.norm.weight":
            state["norm.weight"] = tensor
        elif name == "lm_head.weight":
            if not cfg.tie_word_embeddings:
                state["lm_head.weight"] = tensor
        elif m := _LAYER.fullmatch(name):
            per_layer.setdefault(int(m.group(1)), {})[m.group(2)] = tensor
        else:
            state[name] = tensor  # reported as unexpected by the caller
    for i, parts in per_layer.items():
        for hf_name, ours in _RENAMES.items():
            if hf_name in parts:
                state[f"layers.{i}.{ours}"] = parts.pop(hf_name)
        for ours, hf_names in _FUSED.items():
            if all(n in parts for n in hf_names):
                state[f"layers.{i}.{ours}"] = torch.cat([parts.pop(n) for n in hf_names], dim=0)
        for leftover in parts:
            state[f"model.layers.{i}.{leftover}"] = parts[leftover]
    return state
