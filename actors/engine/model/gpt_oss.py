"""The gpt-oss decoder (`GptOssForCausalLM`) over the same paged KV cache as the Llama family.

What differs from Llama: every attention layer has biases on q, k, v and o, and a learned sink logit
per query head that joins each softmax's denominator and attends nothing (the keys' weights then sum to
less than 1; the kernels take them through `LayerAttention.sinks`); sliding-window and full-attention
layers alternate (`layer_types`); the rope is YaRN-scaled; every MLP is a mixture of experts whose
router has a bias and softmaxes only the top-k logits, and whose experts run a clamped SwiGLU with
biases: (clamp(up, ±limit) + 1) * g * sigmoid(alpha * g), g = min(gate, limit).

The checkpoint stores each layer's experts stacked, gate and up interleaved column by column
(`gate_up_proj` [E, H, 2I]); the loader turns them into SparseMoE's layout (gate rows, then up rows).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from actors.engine.model.attention_backend import LayerAttention
from actors.engine.model.llama import Attention, DecoderLayer, LlamaConfig, LlamaModel
from actors.engine.model.moe import SparseMoE
from actors.engine.model.parallel import TPComm

# transformers' GptOssConfig defaults, for configs that leave these out.
_DEFAULT_ROPE = {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                 "truncate": False, "original_max_position_embeddings": 4096}


@dataclass(frozen=True)
class GptOssConfig(LlamaConfig):
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0

    @classmethod
    def from_hf(cls, hf: dict) -> GptOssConfig:
        missing = [k for k in ("num_local_experts", "num_experts_per_tok") if k not in hf]
        if missing:
            raise ValueError(f"config.json has no {', '.join(repr(k) for k in missing)}")
        if quantized := hf.get("quantization_config"):
            # OpenAI's own checkpoints store the experts as MXFP4 blocks and scales.
            raise ValueError(f"config.json: {quantized.get('quant_method', 'quantized')} weights are not supported; "
                             "use a bfloat16 checkpoint of the model (its experts dequantized)")
        layer_types = hf.get("layer_types") or [
            "sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(hf.get("num_hidden_layers", 0))]
        rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {**_DEFAULT_ROPE, "rope_theta": hf.get(
            "rope_theta", _DEFAULT_ROPE["rope_theta"])}
        base = LlamaConfig.from_hf({"rms_norm_eps": 1e-5, "sliding_window": 128, "max_position_embeddings": 131072,
                                    "attention_bias": True, **hf, "layer_types": layer_types,
                                    "rope_parameters": rope})
        return cls(**{**dataclasses.asdict(base), "num_experts": hf["num_local_experts"],
                      "experts_per_token": hf["num_experts_per_tok"],
                      "expert_intermediate_size": hf["intermediate_size"]},
                   swiglu_alpha=float(hf.get("swiglu_alpha", 1.702)), swiglu_limit=float(hf.get("swiglu_limit", 7.0)))


class GptOssAttention(Attention):
    """Llama's attention with a bias on o and the sink logits."""

    def __init__(self, cfg: GptOssConfig, sliding_window: int | None):
        super().__init__(cfg, sliding_window)
        self.o = nn.Linear(self.q_size, cfg.hidden_size, bias=cfg.attention_bias)
        self.sinks = nn.Parameter(torch.empty(cfg.num_heads))

    @functools.cached_property
    def layer_attention(self) -> LayerAttention:
        """Built on first use, after the sinks are loaded (they are part of what a kernel must know)."""
        return LayerAttention(self.num_heads, self.num_kv_heads, self.head_dim, self.scale, self.sliding_window,
                              self.softcap, sinks=tuple(self.sinks.float().tolist()))


class GptOssExperts(SparseMoE):
    """SparseMoE with gpt-oss's router (a bias; softmax over the top-k logits only) and its clamped,
    biased SwiGLU experts."""

    def __init__(self, cfg: GptOssConfig):
        super().__init__(cfg)
        experts, size, hidden = cfg.num_experts, cfg.expert_intermediate_size, cfg.hidden_size
        self.router = nn.Linear(hidden, experts, bias=True)
        self.gate_up_bias = nn.Parameter(torch.empty(experts, 2 * size))
        self.down_bias = nn.Parameter(torch.empty(experts, hidden))
        self.alpha, self.limit = cfg.swiglu_alpha, cfg.swiglu_limit

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        top, chosen = self.router(x).float().topk(self.top_k, dim=-1)
        return torch.softmax(top, dim=-1), chosen

    def expert(self, index: int, x: torch.Tensor) -> torch.Tensor:
        gate, up = F.linear(x, self.gate_up[index], self.gate_up_bias[index]).chunk(2, dim=-1)
        gate = gate.clamp(max=self.limit)
        up = up.clamp(-self.limit, self.limit)
        return F.linear((up + 1) * (gate * torch.sigmoid(gate * self.alpha)), self.down[index], self.down_bias[index])


class GptOssDecoderLayer(DecoderLayer):
    attn_cls, moe_cls = GptOssAttention, GptOssExperts


class GptOssModel(LlamaModel):
    """Under tensor parallelism each rank holds its query heads' sinks and a slice of every expert's width
    (parallel.rank_slice); o's and the experts' down biases are added once, by rank 0."""

    layer_cls = GptOssDecoderLayer

    def attach(self, comm: TPComm) -> None:
        super().attach(comm)
        if comm.shard.rank != 0:
            # These biases land on outputs the ranks then sum (all_reduce): any rank but one adds zeros.
            with torch.no_grad():
                for layer in self.layers:
                    if layer.attn.o.bias is not None:
                        layer.attn.o.bias.zero_()
                    layer.mlp.down_bias.zero_()
