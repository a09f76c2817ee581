"""Load a Hugging Face checkpoint directory (config.json + *.safetensors, sharded or not).

Checkpoint names are remapped here onto the fused layout of `actors.engine.model.llama`.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from actors.engine.model.checkpoint_reader import Cat, CheckpointFiles, Interleaved, Stack, Transposed
from actors.engine.model.deepseek import DeepseekConfig, DeepseekModel
from actors.engine.model.gemma import Gemma2Config, Gemma2Model, Gemma3Config
from actors.engine.model.gpt_oss import GptOssConfig, GptOssModel
from actors.engine.model.llama import LlamaConfig, LlamaModel
from actors.engine.model.llama4 import Llama4Config, Llama4Model
from actors.engine.model.parallel import TPShard

# Architecture by config.json model_type. Qwen2 is the Llama layout with a qkv bias, Qwen3 with q/k norms,
# Phi-3 with partial longrope, Mixtral and Qwen3-MoE with expert MLPs: LlamaConfig.from_hf reads which.
_BY_MODEL_TYPE = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                  "qwen3": "Qwen3ForCausalLM", "gemma2": "Gemma2ForCausalLM", "gemma3_text": "Gemma3ForCausalLM",
                  "phi3": "Phi3ForCausalLM", "mixtral": "MixtralForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
                  "llama4_text": "Llama4ForCausalLM", "gpt_oss": "GptOssForCausalLM",
                  "deepseek_v2": "DeepseekV2ForCausalLM", "deepseek_v3": "DeepseekV3ForCausalLM"}
SUPPORTED_ARCHITECTURES = set(_BY_MODEL_TYPE.values())
# Families with a decoder of their own (any other is the Llama decoder).
_DECODERS = {"Gemma2ForCausalLM": (Gemma2Config, Gemma2Model), "Gemma3ForCausalLM": (Gemma3Config, Gemma2Model),
             "Llama4ForCausalLM": (Llama4Config, Llama4Model), "GptOssForCausalLM": (GptOssConfig, GptOssModel),
             "DeepseekV2ForCausalLM": (DeepseekConfig, DeepseekModel),
             "DeepseekV3ForCausalLM": (DeepseekConfig, DeepseekModel)}
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
    "self_attn.qkv_proj.weight": "attn.qkv.weight",  # Phi-3 ships these two fused already
    "mlp.gate_up_proj.weight": "mlp.gate_up.weight",
    "block_sparse_moe.gate.weight": "mlp.router.weight",  # Mixtral
    "mlp.gate.weight": "mlp.router.weight",  # Qwen3-MoE
    "mlp.experts.gate_up_proj": "mlp.gate_up",  # experts as saved stacked by transformers 5
    "mlp.experts.down_proj": "mlp.down",
    "feed_forward.down_proj.weight": "mlp.down.weight",  # Llama 4
    "feed_forward.router.weight": "mlp.router.weight",
    "feed_forward.shared_expert.down_proj.weight": "mlp.shared.down.weight",
    "self_attn.o_proj.bias": "attn.o.bias",  # gpt-oss
    "self_attn.sinks": "attn.sinks",
    "mlp.router.weight": "mlp.router.weight",
    "mlp.router.bias": "mlp.router.bias",
    "mlp.experts.gate_up_proj_bias": "mlp.gate_up_bias",
    "mlp.experts.down_proj_bias": "mlp.down_bias",
    # DeepSeek's latent attention and router bias
    "self_attn.q_a_proj.weight": "attn.q_a.weight", "self_attn.q_a_proj.bias": "attn.q_a.bias",
    "self_attn.q_a_layernorm.weight": "attn.q_a_norm.weight", "self_attn.q_b_proj.weight": "attn.q_b.weight",
    "self_attn.kv_a_proj_with_mqa.weight": "attn.kv_a.weight", "self_attn.kv_a_proj_with_mqa.bias": "attn.kv_a.bias",
    "self_attn.kv_a_layernorm.weight": "attn.kv_a_norm.weight", "self_attn.kv_b_proj.weight": "attn.kv_b",
    "mlp.gate.e_score_correction_bias": "mlp.correction_bias",
}
# Llama 4's stacked experts, saved [E, H, 2I] and [E, I, H] (for x @ W): read transposed.
_TRANSPOSED_EXPERTS = {"feed_forward.experts.gate_up_proj": "mlp.gate_up", "feed_forward.experts.down_proj": "mlp.down"}
# One expert's weights, as the hub's Mixtral (w1 gate, w3 up, w2 down) and Qwen3-MoE checkpoints name them.
_EXPERT = re.compile(r"(?:block_sparse_moe|mlp)\.experts\.(\d+)\.(w1|w2|w3|gate_proj|up_proj|down_proj)\.weight")
_EXPERT_PART = {"w1": "gate", "gate_proj": "gate", "w3": "up", "up_proj": "up", "w2": "down", "down_proj": "down"}
# Parts concatenated (in this order) into one fused parameter.
_FUSED = {
    "attn.qkv.weight": ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
    "attn.qkv.bias": ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"),
    "mlp.gate_up.weight": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
    "mlp.shared.gate_up.weight": ("mlp.shared_experts.gate_proj.weight", "mlp.shared_experts.up_proj.weight"),
}
_FUSED_FEED_FORWARD = {  # Llama 4's dense MLP and shared expert
    "mlp.gate_up.weight": ("feed_forward.gate_proj.weight", "feed_forward.up_proj.weight"),
    "mlp.shared.gate_up.weight": ("feed_forward.shared_expert.gate_proj.weight",
                                  "feed_forward.shared_expert.up_proj.weight"),
}
# Multimodal checkpoints whose text model tandem serves: that model's architecture, and the prefix of its
# weights (the others, the vision encoder's and projector's, are not read). The hub's Llama 4 (Scout,
# Maverick) ship this way.
_TEXT_OF_MULTIMODAL = {"Llama4ForConditionalGeneration": ("Llama4ForCausalLM", "language_model.")}
TEXT_WEIGHTS_PREFIX = "text_weights_prefix"  # the key read_hf_config adds for such a checkpoint


def read_hf_config(model_dir: str | Path) -> dict:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise ValueError(f"model directory {model_dir} has no config.json (expected a Hugging Face checkpoint)")
    hf = json.loads(path.read_text())
    multimodal = [a for a in hf.get("architectures") or [] if a in _TEXT_OF_MULTIMODAL]
    if multimodal and isinstance(hf.get("text_config"), dict):
        text_arch, prefix = _TEXT_OF_MULTIMODAL[multimodal[0]]
        hf = {**hf["text_config"], "architectures": [text_arch], TEXT_WEIGHTS_PREFIX: prefix}
    if not hf.get("architectures") and hf.get("model_type") in _BY_MODEL_TYPE:
        # Some exported checkpoints name only the model type.
        hf = {**hf, "architectures": [_BY_MODEL_TYPE[hf["model_type"]]]}
    archs = set(hf.get("architectures") or [])
    if not archs & SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"{path}: architectures {sorted(archs)} not supported; tandem runs {sorted(SUPPORTED_ARCHITECTURES)}"
        )
    return hf


def load_model(model_dir: str | Path, dtype: str = "float32", device: str | torch.device = "cpu",
               context_len: int | None = None, shard: TPShard = TPShard()) -> LlamaModel:
    """`context_len`: the positions the rope covers (the engine's max_model_len; None: the model's
    max_position_embeddings). `shard`: the tensor-parallel rank to load (it reads only its slices)."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} not supported; choose one of {sorted(DTYPES)}")
    hf = read_hf_config(model_dir)
    config_cls, model_cls = next((_DECODERS[a] for a in hf.get("architectures") or [] if a in _DECODERS),
                                 (LlamaConfig, LlamaModel))
    cfg = config_cls.from_hf(hf)
    with torch.device("meta"):
        model = model_cls(cfg, shard)
    target = DTYPES[dtype]
    with CheckpointFiles(Path(model_dir)) as checkpoint:
        sources = _remap(checkpoint, cfg, hf.get(TEXT_WEIGHTS_PREFIX))
        expected = {name for name in model.state_dict() if not (cfg.tie_word_embeddings and name == "lm_head.weight")}
        missing, unexpected = expected - sources.keys(), sources.keys() - expected
        if missing or unexpected:
            raise ValueError(f"checkpoint in {model_dir} does not match the model: missing {sorted(missing)[:5]}, "
                             f"unexpected {sorted(unexpected)[:5]}")
        state = {}
        for name, source in sources.items():
            where = model_cls.rank_slice(name, cfg, shard)
            tensor = source.read(*where) if where else source.read(0, None)
            state[name] = tensor.to(device=device, dtype=target)
    model.load_state_dict(state, strict=False, assign=True)
    model.interleave_rotary_dims()
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    model.build_ropes(context_len or cfg.max_position_embeddings, device)  # they were on meta; stay float32
    return model.eval()


def _remap(checkpoint: dict, cfg: LlamaConfig, text_prefix: str | None = None) -> dict:
    """Checkpoint names -> tandem's parameter names, each a source not yet read (checkpoint_reader).
    `text_prefix`: a multimodal checkpoint's, whose names without it are the text model's."""
    state: dict = {}
    per_layer: dict[int, dict] = {}
    for name, tensor in checkpoint.items():
        if text_prefix is not None:
            if not name.startswith(text_prefix):
                continue
            name = name.removeprefix(text_prefix)
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
        _gpt_oss_experts(parts)
        if i >= cfg.num_layers:
            continue  # past the decoder: DeepSeek-V3's multi-token-prediction layer, which serving skips
        for hf_name, ours in _RENAMES.items():
            if hf_name in parts:
                state[f"layers.{i}.{ours}"] = parts.pop(hf_name)
        for ours, hf_names in (*_FUSED.items(), *_FUSED_FEED_FORWARD.items()):
            if all(n in parts for n in hf_names):
                state[f"layers.{i}.{ours}"] = Cat([parts.pop(n) for n in hf_names])
        for hf_name, ours in _TRANSPOSED_EXPERTS.items():
            if hf_name in parts:
                state[f"layers.{i}.{ours}"] = Transposed(parts.pop(hf_name))
        # After the fusing: a q_proj left over is a DeepSeek q without q_lora_rank.
        for hf_name, ours in (("mlp.shared_experts.down_proj.weight", "mlp.shared.down.weight"),
                              ("self_attn.q_proj.weight", "attn.q.weight")):
            if hf_name in parts:
                state[f"layers.{i}.{ours}"] = parts.pop(hf_name)
        state.update({f"layers.{i}.{name}": t for name, t in _stack_experts(parts).items()})
        for leftover in parts:
            state[f"model.layers.{i}.{leftover}"] = parts[leftover]
    return state


def _gpt_oss_experts(parts: dict) -> None:
    """gpt-oss's experts (recognized by their biases) in `parts`, turned into SparseMoE's layout in place."""
    if "mlp.experts.gate_up_proj_bias" not in parts or "mlp.experts.gate_up_proj" not in parts:
        return
    for name in ("mlp.experts.gate_up_proj", "mlp.experts.gate_up_proj_bias"):
        parts[name] = Interleaved(parts[name])
    if "mlp.experts.down_proj" in parts:
        parts["mlp.experts.down_proj"] = Transposed(parts["mlp.experts.down_proj"])


def _stack_experts(parts: dict) -> dict:
    """Pops one layer's per-expert weights out of `parts`; returns them stacked as `mlp.gate_up` [E, 2I, H]
    and `mlp.down` [E, H, I] (nothing if the layer has no experts, or an expert lacks a part: the caller
    then reports what is left over)."""
    experts: dict[int, dict[str, str]] = {}
    for name in parts:
        if m := _EXPERT.fullmatch(name):
            experts.setdefault(int(m.group(1)), {})[_EXPERT_PART[m.group(2)]] = name
    if not experts or sorted(experts) != list(range(len(experts))) or any(len(e) != 3 for e in experts.values()):
        return {}
    names = [experts[e] for e in range(len(experts))]
    gate_up = Stack([Cat([parts.pop(n["gate"]), parts.pop(n["up"])]) for n in names])
    down = Stack([parts.pop(n["down"]) for n in names])
    return {"mlp.gate_up": gate_up, "mlp.down": down}
