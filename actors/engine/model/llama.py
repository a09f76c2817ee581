"""The Llama family decoder (Llama 2/3, Mistral; Qwen2 adds a qkv bias, Qwen3 a per-head RMSNorm on q and
k before the rotary embedding) over a paged KV cache.

Weights use fused projections (qkv, gate_up): fewer, larger matmuls per layer. The loader maps
Hugging Face checkpoint names onto them; `forward` never sees checkpoint names.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from actors.engine.model.attention import AttentionBatch, paged_attention


@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None  # HF rope parameters for non-default rope types (llama3, linear)
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    sliding_windows: tuple[int | None, ...]  # per layer; None = full attention
    qk_norm: bool = False  # Qwen3: RMSNorm over each head of q and k

    @classmethod
    def from_hf(cls, hf: dict) -> "LlamaConfig":
        """Read a Hugging Face config.json dict (old `rope_scaling`/`rope_theta` or new `rope_parameters`)."""
        missing = [k for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                               "num_attention_heads") if k not in hf]
        if missing:
            raise ValueError(f"config.json has no {', '.join(repr(k) for k in missing)}")
        num_heads = hf["num_attention_heads"]
        rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
        rope_theta = float(rope.pop("rope_theta", hf.get("rope_theta", 10000.0)))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", "llama3", "linear"):
            raise ValueError(f"unsupported rope type {rope_type!r} in config.json (supported: default, llama3, linear)")
        num_layers = hf["num_hidden_layers"]
        model_type = hf.get("model_type", "llama")
        window = hf.get("sliding_window")
        if model_type in ("qwen2", "qwen3") and not hf.get("use_sliding_window", False):
            window = None
        layer_types = hf.get("layer_types") or ["sliding_attention" if window else "full_attention"] * num_layers
        windows = tuple(window if kind == "sliding_attention" else None for kind in layer_types)
        if len(windows) != num_layers:
            raise ValueError(f"config.json: layer_types names {len(windows)} layers, num_hidden_layers is {num_layers}")
        return cls(
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=hf.get("num_key_value_heads") or num_heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // num_heads,
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=rope_theta,
            rope_scaling=None if rope_type == "default" else {**rope, "rope_type": rope_type},
            max_position_embeddings=hf.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention_bias=bool(hf.get("attention_bias", model_type == "qwen2")),
            sliding_windows=windows,
            qk_norm=model_type == "qwen3",
        )


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope_inverse_frequencies(cfg: LlamaConfig) -> torch.Tensor:
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.float32) / cfg.head_dim))
    scaling = cfg.rope_scaling
    if scaling is None:
        return inv_freq
    factor = float(scaling["factor"])
    if scaling["rope_type"] == "linear":
        return inv_freq / factor
    # llama3: long wavelengths are slowed by `factor`, short ones kept, the band between interpolated.
    old_len = scaling["original_max_position_embeddings"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    in_band = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(in_band, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """cos/sin tables for every position, computed once in float32 (rotate-half layout, as HF)."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        t = torch.arange(cfg.max_position_embeddings, dtype=torch.float32)
        freqs = torch.outer(t, rope_inverse_frequencies(cfg))
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        cos = self.cos[positions].unsqueeze(1)  # [T, 1, D]
        sin = self.sin[positions].unsqueeze(1)
        return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return (x.float() * cos + rotated.float() * sin).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig, sliding_window: int | None):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.qkv = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        self.o = nn.Linear(self.q_size, cfg.hidden_size, bias=False)
        self.scale = cfg.head_dim**-0.5
        self.softcap: float | None = None  # tanh cap on the scores (Gemma 2)
        self.sliding_window = sliding_window
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.qk_norm = cfg.qk_norm

    def forward(self, x, positions, rope: RotaryEmbedding, kv_cache, batch: AttentionBatch):
        q, k, v = self.qkv(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rope(positions, q, k)
        out = paged_attention(q, k, v, kv_cache[0], kv_cache[1], batch, self.scale, self.sliding_window,
                              softcap=self.softcap)
        return self.o(out.reshape(-1, self.q_size))


class MLP(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.gate_up = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x):
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: LlamaConfig, sliding_window: int | None):
        super().__init__()
        self.input_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attn = Attention(cfg, sliding_window)
        self.post_attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, positions, rope, kv_cache, batch):
        x = x + self.attn(self.input_norm(x), positions, rope, kv_cache, batch)
        return x + self.mlp(self.post_attn_norm(x))


class LlamaModel(nn.Module):
    """Also the frame of the other decoders (gemma.py): they change the layer, the norm, and what happens to
    the embeddings and the logits (`embed`, `final_logits`)."""

    layer_cls = DecoderLayer
    norm_cls = RMSNorm

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(self.layer_cls(cfg, w) for w in cfg.sliding_windows)
        self.norm = self.norm_cls(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.rope = RotaryEmbedding(cfg)

    @property
    def windows(self) -> tuple[int | None, ...]:
        """The distinct attention windows of the layers (None: full attention): a step builds a mask for each."""
        return tuple(dict.fromkeys(self.cfg.sliding_windows))

    def forward(
        self,
        input_ids: torch.Tensor,
        batch: AttentionBatch,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        sample_idx: torch.Tensor,
    ) -> torch.Tensor:
        """Run the flat batch; return float32 logits only for the rows in `sample_idx`."""
        x = self.embed(input_ids)
        for layer, kv in zip(self.layers, kv_caches):
            x = layer(x, batch.positions, self.rope, kv, batch)
        x = self.norm(x[sample_idx])
        return self.final_logits(self.lm_head(x).float())

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def final_logits(self, logits: torch.Tensor) -> torch.Tensor:
        return logits
