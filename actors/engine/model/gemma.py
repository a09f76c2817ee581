"""The Gemma 2 decoder over the same paged KV cache as the Llama family.

What differs from Llama: the embeddings are scaled by sqrt(hidden_size); every RMSNorm multiplies by
(1 + weight) in float32; each layer norms the attention and MLP outputs too (pre and post norms); the
MLP is GeGLU (tanh-approximated GELU); attention scores are scaled by query_pre_attn_scalar^-0.5 and
soft-capped (tanh(s / cap) * cap), as are the final logits; sliding-window and full-attention layers
alternate (per-layer windows, from `layer_types`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from actors.engine.model.attention import AttentionBatch, paged_attention
from actors.engine.model.llama import LlamaConfig, LlamaModel, RotaryEmbedding


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


class GemmaRMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).type_as(x)


class GemmaAttention(nn.Module):
    def __init__(self, cfg: Gemma2Config, sliding_window: int | None):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size, self.kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.qkv = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        self.o = nn.Linear(self.q_size, cfg.hidden_size, bias=False)
        self.scale = cfg.query_pre_attn_scalar**-0.5
        self.softcap = cfg.attn_logit_softcapping
        self.sliding_window = sliding_window

    def forward(self, x, positions, rope: RotaryEmbedding, kv_cache, batch: AttentionBatch):
        q, k, v = self.qkv(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = rope(positions, q.view(-1, self.num_heads, self.head_dim), k.view(-1, self.num_kv_heads, self.head_dim))
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        out = paged_attention(q, k, v, kv_cache[0], kv_cache[1], batch, self.scale, self.sliding_window,
                              softcap=self.softcap)
        return self.o(out.reshape(-1, self.q_size))


class GemmaMLP(nn.Module):
    def __init__(self, cfg: Gemma2Config):
        super().__init__()
        self.gate_up = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x):
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.gelu(gate, approximate="tanh") * up)


class GemmaDecoderLayer(nn.Module):
    def __init__(self, cfg: Gemma2Config, sliding_window: int | None):
        super().__init__()
        eps = cfg.rms_norm_eps
        self.input_norm, self.post_attn_norm = GemmaRMSNorm(cfg.hidden_size, eps), GemmaRMSNorm(cfg.hidden_size, eps)
        self.pre_ffn_norm, self.post_ffn_norm = GemmaRMSNorm(cfg.hidden_size, eps), GemmaRMSNorm(cfg.hidden_size, eps)
        self.attn = GemmaAttention(cfg, sliding_window)
        self.mlp = GemmaMLP(cfg)

    def forward(self, x, positions, rope, kv_cache, batch):
        x = x + self.post_attn_norm(self.attn(self.input_norm(x), positions, rope, kv_cache, batch))
        return x + self.post_ffn_norm(self.mlp(self.pre_ffn_norm(x)))


class Gemma2Model(LlamaModel):
    layer_cls = GemmaDecoderLayer
    norm_cls = GemmaRMSNorm

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        # The scale is rounded to the weights' dtype first, as the checkpoints were trained with.
        return x * torch.tensor(self.cfg.hidden_size**0.5, dtype=x.dtype)

    def final_logits(self, logits: torch.Tensor) -> torch.Tensor:
        cap = self.cfg.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap
