"""Rotary position embeddings: the frequency schedules (default, linear, llama3, longrope, yarn) and the cos/sin
tables every layer reads.

A rope is fixed for the life of a deployment: its tables cover `context_len` (the engine's max_model_len)
positions, and longrope (Phi-3) picks its long or short factors once, from that length, as vLLM does.
Transformers picks per forward pass from the sequence's current length, which makes a token's K depend
on how long its sequence had grown when it was computed; a cache shared across requests, chunked
prefill and a KV handoff all need a K that depends only on the token's position.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

ROPE_TYPES = ("default", "linear", "llama3", "longrope", "yarn")


@dataclass(frozen=True)
class RopeSpec:
    theta: float
    scaling: dict | None  # HF rope parameters for the non-default types, with "rope_type"
    rotary_dim: int  # the leading dims of each head that rotate (Phi-3/4: partial_rotary_factor < 1)
    max_position_embeddings: int


def read_rope_parameters(hf: dict, where: str = "config.json") -> tuple[float, dict | None]:
    """(theta, scaling) from HF's `rope_parameters` (transformers 5) or `rope_scaling` + `rope_theta`."""
    rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    theta = float(rope.pop("rope_theta", hf.get("rope_theta", 10000.0)))
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    rope_type = "longrope" if rope_type == "su" else rope_type  # Phi-3's first configs call it "su"
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"unsupported rope type {rope_type!r} in {where} (supported: {', '.join(ROPE_TYPES)})")
    if rope_type == "default":
        return theta, None
    scaling = {**rope, "rope_type": rope_type}
    if rope_type in ("longrope", "yarn"):
        scaling.setdefault("original_max_position_embeddings", hf.get("original_max_position_embeddings"))
        needed = ("short_factor", "long_factor") if rope_type == "longrope" else ()
        missing = [k for k in (*needed, "original_max_position_embeddings") if scaling.get(k) is None]
        if missing:
            raise ValueError(f"{where}: {rope_type} scaling has no {', '.join(repr(k) for k in missing)}")
    return theta, scaling


def inverse_frequencies(spec: RopeSpec, context_len: int) -> tuple[torch.Tensor, float]:
    """The rotation speed of each pair of dims, and the factor cos and sin are scaled by."""
    dim = spec.rotary_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    inv_freq = 1.0 / (spec.theta**exponents)
    scaling = spec.scaling
    if scaling is None:
        return inv_freq, 1.0
    kind = scaling["rope_type"]
    if kind == "linear":
        return inv_freq / float(scaling["factor"]), 1.0
    if kind == "longrope":
        return _longrope(spec, exponents, context_len)
    if kind == "yarn":
        return _yarn(spec, inv_freq)
    return _llama3(inv_freq, scaling), 1.0


def _longrope(spec: RopeSpec, exponents: torch.Tensor, context_len: int) -> tuple[torch.Tensor, float]:
    scaling = spec.scaling
    original = scaling["original_max_position_embeddings"]
    factors = scaling["long_factor"] if context_len > original else scaling["short_factor"]
    if len(factors) != spec.rotary_dim // 2:
        raise ValueError(f"longrope factors have {len(factors)} entries; the rotary dim {spec.rotary_dim} needs "
                         f"{spec.rotary_dim // 2}")
    inv_freq = 1.0 / (torch.tensor(factors, dtype=torch.float32) * spec.theta**exponents)
    factor = scaling.get("factor") or spec.max_position_embeddings / original
    attention = scaling.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    return inv_freq, float(attention)


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction for a context stretched `factor` times (1 when not stretched)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _yarn(spec: RopeSpec, inv_freq: torch.Tensor) -> tuple[torch.Tensor, float]:
    """YaRN: dims that turn many times within the original context keep their speed, those that turn
    less than once are slowed by `factor`, a linear ramp between; cos and sin are scaled by the
    attention factor (DeepSeek's `mscale / mscale_all_dim` ratio when both are given)."""
    scaling, dim = spec.scaling, spec.rotary_dim
    original = scaling["original_max_position_embeddings"]
    factor = scaling.get("factor") or spec.max_position_embeddings / original
    attention = scaling.get("attention_factor")
    if attention is None:
        mscale, mscale_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attention = (yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all) if mscale and mscale_all
                     else yarn_mscale(factor))
    base = spec.theta

    def dim_of(rotations: float) -> float:  # the dim that turns `rotations` times over the original context
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = dim_of(scaling.get("beta_fast") or 32), dim_of(scaling.get("beta_slow") or 1)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / ((high - low) or 0.001)).clamp(0, 1)
    kept = 1 - ramp  # the share of each dim's original speed
    return inv_freq / factor * (1 - kept) + inv_freq * kept, float(attention)


def _llama3(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    """Long wavelengths are slowed by `factor`, short ones kept, the band between interpolated."""
    factor = float(scaling["factor"])
    old_len = scaling["original_max_position_embeddings"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    in_band = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(in_band, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """Rotations for positions 0 .. context_len-1, computed once in float32; only the first `rotary_dim`
    dims of each head turn.

    Layout: Hugging Face's rotate-half layout pairs dim j with dim j + rotary_dim/2. Here each pair sits
    side by side (the loader permutes the q/k projection rows and q/k norm weights once, with
    `interleave_rotary`), so a rotation is one complex multiply instead of five passes over q and k (a
    negation, a concatenation, two products and a sum). Attention scores are unchanged (q . k sums over
    the dims, in any order); the KV cache holds keys in this layout on every worker alike."""

    def __init__(self, spec: RopeSpec, context_len: int):
        super().__init__()
        # Computed on the CPU even while a model is built on the meta device: arithmetic on meta tensors
        # imports torch._dynamo, 1-3 s of every worker's start.
        with torch.device("cpu"):
            inv_freq, scale = inverse_frequencies(spec, context_len)
            angles = torch.outer(torch.arange(context_len, dtype=torch.float32), inv_freq)
            turns = torch.polar(torch.full_like(angles, scale), angles)
        self.rotary_dim = spec.rotary_dim
        self.register_buffer("turns", turns, persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        turns = self.turns[positions].unsqueeze(1)  # [T, 1, rotary_dim / 2], complex
        return self._turn(q, turns), self._turn(k, turns)

    def _turn(self, x: torch.Tensor, turns: torch.Tensor) -> torch.Tensor:
        if self.rotary_dim == x.shape[-1]:
            return _rotate(x, turns)
        out = x.clone()
        out[..., : self.rotary_dim] = _rotate(x[..., : self.rotary_dim], turns)
        return out


def _rotate(x: torch.Tensor, turns: torch.Tensor) -> torch.Tensor:
    pairs = torch.view_as_complex(x.float().unflatten(-1, (-1, 2)))
    return torch.view_as_real(pairs * turns).flatten(-2).to(x.dtype)


def interleave_rotary(rows: torch.Tensor, num_heads: int, head_dim: int, rotary_dim: int) -> torch.Tensor:
    """`rows` (first dim num_heads x head_dim: a q or k projection's weight or bias, or a per-head norm's
    weight with num_heads 1) reordered from the rotate-half layout to RotaryEmbedding's pairs."""
    half = rotary_dim // 2
    order = [d for j in range(half) for d in (j, j + half)] + list(range(rotary_dim, head_dim))
    heads = rows.reshape(num_heads, head_dim, *rows.shape[1:])
    return heads[:, order].reshape(rows.shape)
