"""The Gemma 2 and Gemma 3 decoders over the same paged KV cache as the Llama family.

What differs from Llama: the embeddings are scaled by sqrt(hidden_size); every RMSNorm multiplies by
(1 + weight) in float32; each layer norms the attention and MLP outputs too (pre and post norms); the
MLP is GeGLU (tanh-approximated GELU); attention scores are scaled by query_pre_attn_scalar^-0.5 and
soft-capped (tanh(s / cap) * cap), as are the final logits; sliding-window and full-attention layers
alternate (per-layer windows, from `layer_types`).

Gemma 3 adds a (1 + w) RMSNorm on each head of q and k, gives its sliding layers a rope of their own
(base `rope_local_base_freq`, unscaled; the full layers' rope may be scaled), and interleaves five
sliding layers to one full layer by default (`sliding_window_pattern`); it drops the soft caps.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from actors.engine.model.llama import MLP, Attention, LlamaConfig, LlamaModel, normalized


@dataclass(frozen=True)
class Gemma2Config(LlamaConfig):
    query_pre_attn_scalar: float = 256.0
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None

    @classmethod
    def from_hf(cls, hf: dict) -> Gemma2Config:
        act = hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh"
        if act != "gelu_pytorch_tanh":
            raise ValueError(f"config.json: hidden_activation {act!r} not supported for Gemma 2 (gelu_pytorch_tanh)")
        base = LlamaConfig.from_hf({**hf, "tie_word_embeddings": hf.get("tie_word_embeddings", True)})
        return cls(**dataclasses.asdict(base),
                   query_pre_attn_scalar=float(hf.get("query_pre_attn_scalar", 256)),
                   attn_logit_softcapping=hf.get("attn_logit_softcapping"),
                   final_logit_softcapping=hf.get("final_logit_softcapping"))


@dataclass(frozen=True)
class Gemma3Config(Gemma2Config):
    @classmethod
    def from_hf(cls, hf: dict) -> Gemma3Config:
        if hf.get("use_bidirectional_attention"):
            raise ValueError("config.json: use_bidirectional_attention is not supported (tandem decodes causally)")
        rope = hf.get("rope_parameters") or {}
        if "full_attention" in rope:  # transformers 5: one rope per layer type
            full, local = rope["full_attention"], rope.get("sliding_attention") or {}
        else:
            full = {**(hf.get("rope_scaling") or {}), "rope_theta": hf.get("rope_theta", 1_000_000.0)}
            local = {"rope_theta": hf.get("rope_local_base_freq", 10_000.0)}
        if local.get("rope_type", "default") != "default":
            raise ValueError(f"config.json: Gemma 3's sliding layers use a plain rope, not {local['rope_type']!r}")
        pattern = hf.get("sliding_window_pattern", 6)
        layer_types = hf.get("layer_types") or [
            "sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(hf.get("num_hidden_layers", 0))
        ]
        base = Gemma2Config.from_hf({**hf, "rope_parameters": full, "rope_scaling": None, "layer_types": layer_types})
        return cls(**{**dataclasses.asdict(base), "qk_norm": True,
                      "local_rope_theta": float(local.get("rope_theta", 10_000.0))})


class GemmaRMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return normalized(x, self.eps).mul_(1.0 + self.weight.float()).type_as(x)


class GemmaAttention(Attention):
    """Llama's attention with Gemma's query scale and its cap on the scores."""

    qk_norm_cls = GemmaRMSNorm

    def __init__(self, cfg: Gemma2Config, sliding_window: int | None):
        super().__init__(cfg, sliding_window)
        self.scale = cfg.query_pre_attn_scalar**-0.5
        self.softcap = cfg.attn_logit_softcapping


class GemmaMLP(MLP):
    """GeGLU: Llama's gated MLP with the tanh-approximated GELU."""

    def act(self, gate: torch.Tensor) -> torch.Tensor:
        return F.gelu(gate, approximate="tanh")


class GemmaDecoderLayer(nn.Module):
    def __init__(self, cfg: Gemma2Config, index: int):
        super().__init__()
        eps = cfg.rms_norm_eps
        self.input_norm, self.post_attn_norm = GemmaRMSNorm(cfg.hidden_size, eps), GemmaRMSNorm(cfg.hidden_size, eps)
        self.pre_ffn_norm, self.post_ffn_norm = GemmaRMSNorm(cfg.hidden_size, eps), GemmaRMSNorm(cfg.hidden_size, eps)
        self.attn = GemmaAttention(cfg, cfg.sliding_windows[index])
        self.mlp = GemmaMLP(cfg)

    def forward(self, x, positions, rope, kv_cache, batch):
        x = x.add_(self.post_attn_norm(self.attn(self.input_norm(x), positions, rope, kv_cache, batch)))
        return x.add_(self.post_ffn_norm(self.mlp(self.pre_ffn_norm(x))))


class Gemma2Model(LlamaModel):
    layer_cls = GemmaDecoderLayer
    norm_cls = GemmaRMSNorm

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = super().embed(input_ids)
        # The scale is rounded to the weights' dtype first, as the checkpoints were trained with.
        return x * torch.tensor(self.cfg.hidden_size**0.5, dtype=x.dtype)

    def final_logits(self, logits: torch.Tensor) -> torch.Tensor:
        cap = self.cfg.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap
