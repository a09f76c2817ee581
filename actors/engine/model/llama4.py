"""The Llama 4 text decoder (`Llama4ForCausalLM`, config.json model_type `llama4_text`) over the same paged KV
cache as the Llama family.

What differs from Llama:
- Two kinds of attention layer (`no_rope_layers`, 1 where a layer rotates): rope layers attend only within
  their chunk of `attention_chunk_size` positions (a token at p sees p - p % chunk .. p; `layer_types`
  says which layers are chunked, by default the rope ones) and, with `use_qk_norm`, L2-normalize each head
  of q and k after the rotation (an RMSNorm without a weight); NoPE layers attend to the whole context
  unrotated, their queries scaled by 1 + attn_scale * log(1 + floor((p + 1) / floor_scale))
  (`attn_temperature_tuning`).
- The rotation turns adjacent pairs of dims (Meta's complex form), already the pair layout of
  rope.py's RotaryEmbedding: q and k rows stay in checkpoint order.
- Every `interleave_moe_layer_step`-th layer (`moe_layers`) is a mixture of experts: a top-k router whose
  chosen logits pass through a sigmoid and scale the token's input to each expert, plus a shared expert
  every token runs; the other layers are dense MLPs of width `intermediate_size_mlp`.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import torch
from torch import nn

from actors.engine.model.attention_backend import LayerAttention, StepAttention
from actors.engine.model.llama import MLP, Attention, DecoderLayer, LlamaConfig, LlamaModel, RMSNorm, normalized
from actors.engine.model.moe import SparseMoE
from actors.engine.model.rope import RotaryEmbedding


@dataclass(frozen=True)
class Llama4Config(LlamaConfig):
    rope_layers: tuple[bool, ...] = ()  # per layer: True where it rotates q and k (HF's no_rope_layers)
    attention_chunks: tuple[int | None, ...] = ()  # per layer: its chunk (layer_types), None: the whole context
    l2_qk_norm: bool = False  # use_qk_norm, on the rope layers only
    attn_temperature_tuning: bool = False
    floor_scale: float = 8192.0
    attn_scale: float = 0.1

    @classmethod
    def from_hf(cls, hf: dict) -> Llama4Config:
        if hf.get("attention_bias"):
            raise ValueError("config.json: attention_bias is not supported for Llama 4 (no released model has one)")
        act = hf.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"config.json: hidden_act {act!r} not supported for Llama 4 (silu)")
        n = hf.get("num_hidden_layers", 0)
        interval = hf.get("no_rope_layer_interval", 4)
        rope_layers = hf.get("no_rope_layers") or [int((i + 1) % interval != 0) for i in range(n)]
        step = hf.get("interleave_moe_layer_step", 1)
        moe_layers = hf.get("moe_layers")
        moe_layers = set(range(step - 1, n, step) if moe_layers is None else moe_layers)
        if len(rope_layers) != n:
            raise ValueError(f"config.json: no_rope_layers names {len(rope_layers)} layers, num_hidden_layers is {n}")
        # The dense layers' width is intermediate_size_mlp; intermediate_size is each expert's (and the
        # shared expert's).
        base = LlamaConfig.from_hf({**hf, "intermediate_size": hf.get("intermediate_size_mlp", 16384),
                                    "layer_types": None, "sliding_window": None})
        chunk = hf.get("attention_chunk_size")
        layer_types = hf.get("layer_types") or [
            "chunked_attention" if rotates and chunk else "full_attention" for rotates in rope_layers]
        if len(layer_types) != n:
            raise ValueError(f"config.json: layer_types names {len(layer_types)} layers, num_hidden_layers is {n}")
        if "chunked_attention" in layer_types and not chunk:
            raise ValueError("config.json: chunked_attention layers need attention_chunk_size")
        return cls(**{**dataclasses.asdict(base),
                      "num_experts": hf.get("num_local_experts", 16),
                      "experts_per_token": hf.get("num_experts_per_tok", 1),
                      "expert_intermediate_size": hf.get("intermediate_size", 8192),
                      "dense_layers": tuple(i for i in range(n) if i not in moe_layers)},
                   rope_layers=tuple(bool(r) for r in rope_layers),
                   attention_chunks=tuple(chunk if kind == "chunked_attention" else None for kind in layer_types),
                   l2_qk_norm=bool(hf.get("use_qk_norm", True)),
                   attn_temperature_tuning=bool(hf.get("attn_temperature_tuning", True)),
                   floor_scale=float(hf.get("floor_scale", 8192)), attn_scale=float(hf.get("attn_scale", 0.1)))


class Llama4Attention(Attention):
    def __init__(self, cfg: Llama4Config, index: int):
        super().__init__(cfg, None)
        self.rotates = cfg.rope_layers[index]
        self.chunk = cfg.attention_chunks[index]
        self.l2_norm = cfg.l2_qk_norm and self.rotates
        self.eps = cfg.rms_norm_eps
        self.tuned = cfg.attn_temperature_tuning and not self.rotates
        self.floor_scale, self.attn_scale = cfg.floor_scale, cfg.attn_scale

    def interleave_rotary_dims(self, rotary_dim: int) -> None:
        """Nothing to do: Llama 4 already rotates adjacent pairs, RotaryEmbedding's layout."""

    @functools.cached_property
    def layer_attention(self) -> LayerAttention:
        return LayerAttention(self.num_heads, self.num_kv_heads, self.head_dim, self.scale, None, None, chunk=self.chunk)

    def forward(self, x, positions, rope: RotaryEmbedding, kv_cache, batch: StepAttention):
        q, k, v = self.qkv(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.rotates:
            q, k = rope(positions, q, k)
        if self.l2_norm:
            q, k = normalized(q, self.eps).to(q.dtype), normalized(k, self.eps).to(k.dtype)
        if self.tuned:
            # Long contexts: the global layers' queries sharpen with log(position) (floor_scale steps).
            scales = torch.log1p(torch.floor((positions.float() + 1.0) / self.floor_scale)) * self.attn_scale + 1.0
            q = (q * scales[:, None, None]).to(q.dtype)
        out = batch.attend(q, k, v, kv_cache[0], kv_cache[1], self.layer_attention)
        return self.tp.all_reduce(self.o(out.reshape(-1, self.q_size)))


class Llama4MoE(SparseMoE):
    """Top-k experts by router logit, each given the token scaled by sigmoid(its logit), plus a shared
    expert (a dense MLP as wide as one expert) that every token runs."""

    scales_inputs = True

    def __init__(self, cfg: Llama4Config):
        super().__init__(cfg)
        self.shared = MLP(dataclasses.replace(cfg, intermediate_size=cfg.expert_intermediate_size))

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits, chosen = self.router(x).topk(self.top_k, dim=-1)
        return torch.sigmoid(logits.float()), chosen

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.shared(x).add_(super().forward(x))


class Llama4DecoderLayer(DecoderLayer):
    """Llama's layer (its norms and residuals, its forward) with Llama 4's attention and MLPs."""

    def __init__(self, cfg: Llama4Config, index: int):
        nn.Module.__init__(self)  # not DecoderLayer's: it would build Llama's attention and MLP first
        self.input_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attn = Llama4Attention(cfg, index)
        self.post_attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = Llama4MoE(cfg) if cfg.is_moe_layer(index) else MLP(cfg)


class Llama4Model(LlamaModel):
    layer_cls = Llama4DecoderLayer
