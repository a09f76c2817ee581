"""The DeepSeek-V2 and DeepSeek-V3 decoders: multi-head latent attention (MLA) over a paged latent cache,
and a mixture of experts with shared experts, grouped routing and a few dense first layers.

What differs from Llama:
- attention: q comes through a low-rank bottleneck (`q_a` -> RMSNorm -> `q_b`, or one `q` projection);
  keys and values through a latent: `kv_a` projects each token to `kv_lora_rank` values (then
  RMSNorm'd) plus one rotary key of `qk_rope_head_dim` shared by every head, and `kv_b` expands the
  latent into each head's non-rotary key and its value. The cache keeps only the latent and the
  rotary key (mla_attention.py), 576 values a token a layer at DeepSeek-V3's size;
- the softmax scale is qk_head_dim^-0.5 times YaRN's mscale(mscale_all_dim) squared;
- the rope rotates adjacent pairs (V2 always, V3 with `rope_interleave`), which is tandem's own pair
  layout, so only V3 checkpoints without `rope_interleave` have their rows permuted at load;
- MoE layers (all but the first `first_k_dense_replace`) add shared experts to the routed ones. V3
  routes by sigmoid scores plus a correction bias, within the `topk_group` of `n_group` groups whose
  two best experts score highest, then weighs the chosen experts by their plain scores (renormalized
  with `norm_topk_prob`); V2 by softmax scores (within the groups whose best expert scores highest when
  `topk_method` is group_limited_greedy). Both scale the weights by `routed_scaling_factor`.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from actors.engine.model.attention_backend import LayerAttention
from actors.engine.model.llama import MLP, LlamaConfig, LlamaModel, RMSNorm
from actors.engine.model.mla_attention import LatentWeights, attend_latent, latent_page_width
from actors.engine.model.moe import SparseMoE
from actors.engine.model.parallel import SINGLE, TPComm, TPShard, rank_slice
from actors.engine.model.rope import interleave_rotary, read_rope_parameters, yarn_mscale

_LATENT_NORM_EPS = 1e-6  # the q and kv latents' RMSNorms use their default eps, not rms_norm_eps
_REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
             "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "moe_intermediate_size",
             "n_routed_experts", "num_experts_per_tok")


@dataclass(frozen=True)
class DeepseekConfig(LlamaConfig):
    q_lora_rank: int | None = None  # None: q has one projection (DeepSeek-V2-Lite)
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    rope_interleave: bool = True  # the checkpoint's rotary dims are adjacent pairs
    softmax_scale: float = 1.0
    shared_expert_size: int = 0  # moe_intermediate_size * n_shared_experts (0: none)
    scoring: str = "sigmoid"  # "sigmoid" (V3, with a correction bias) or "softmax" (V2)
    num_groups: int = 1
    groups_per_token: int = 1
    routed_scaling_factor: float = 1.0
    tp_split_fields: ClassVar[tuple[str, ...]] = ("shared_expert_size",)  # widths a tensor-parallel rank splits

    @classmethod
    def from_hf(cls, hf: dict) -> DeepseekConfig:
        missing = [k for k in _REQUIRED if k not in hf]
        if missing:
            raise ValueError(f"config.json has no {', '.join(repr(k) for k in missing)}")
        quantization = (hf.get("quantization_config") or {}).get("quant_method")
        if quantization:
            raise ValueError(f"config.json: a {quantization}-quantized checkpoint (DeepSeek-V3's release is fp8 with "
                             "block scales); tandem reads bfloat16 or float32 weights: convert it first")
        if hf.get("hidden_act", "silu") != "silu" or hf.get("mlp_bias"):
            raise ValueError("config.json: DeepSeek models with hidden_act other than silu or an mlp_bias are not supported")
        v3 = hf.get("model_type") == "deepseek_v3"
        grouped = v3 or hf.get("topk_method") == "group_limited_greedy"
        rope_theta, rope_scaling = read_rope_parameters(hf)
        qk_head_dim = hf["qk_nope_head_dim"] + hf["qk_rope_head_dim"]
        scale = qk_head_dim**-0.5
        if rope_scaling and rope_scaling.get("mscale_all_dim"):
            factor = rope_scaling.get("factor") or (hf.get("max_position_embeddings", 4096)
                                                    / rope_scaling["original_max_position_embeddings"])
            scale *= yarn_mscale(factor, rope_scaling["mscale_all_dim"]) ** 2
        layers = hf["num_hidden_layers"]
        return cls(
            vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"], intermediate_size=hf["intermediate_size"],
            num_layers=layers, num_heads=hf["num_attention_heads"], num_kv_heads=hf["num_attention_heads"],
            head_dim=hf["qk_rope_head_dim"],  # the rope's width (RopeSpec), as transformers sets it
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6), rope_theta=rope_theta, rope_scaling=rope_scaling,
            max_position_embeddings=hf.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention_bias=bool(hf.get("attention_bias", False)), sliding_windows=(None,) * layers,
            num_experts=hf["n_routed_experts"], experts_per_token=hf["num_experts_per_tok"],
            expert_intermediate_size=hf["moe_intermediate_size"],
            normalize_expert_weights=v3 and bool(hf.get("norm_topk_prob", True)),
            dense_layers=tuple(range(min(layers, hf.get("first_k_dense_replace", 3 if v3 else 0)))),
            q_lora_rank=hf.get("q_lora_rank"), kv_lora_rank=hf["kv_lora_rank"],
            qk_nope_head_dim=hf["qk_nope_head_dim"], qk_rope_head_dim=hf["qk_rope_head_dim"],
            v_head_dim=hf["v_head_dim"], rope_interleave=bool(hf.get("rope_interleave", True)) or not v3,
            softmax_scale=scale, shared_expert_size=hf["moe_intermediate_size"] * (hf.get("n_shared_experts") or 0),
            scoring="sigmoid" if v3 else "softmax",
            num_groups=(hf.get("n_group") or 1) if grouped else 1,
            groups_per_token=(hf.get("topk_group") or 1) if grouped else 1,
            routed_scaling_factor=float(hf.get("routed_scaling_factor", 2.5 if v3 else 1.0)),
        )


class LatentAttention(nn.Module):
    """MLA: the layer computes q, the token's latent and its rotary key; mla_attention.py caches the
    latent and attends over it."""

    tp: TPComm = SINGLE

    def __init__(self, cfg: DeepseekConfig):
        super().__init__()
        self.num_heads, self.rank = cfg.num_heads, cfg.kv_lora_rank
        self.nope, self.rope_dim, self.v_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        qk = self.nope + self.rope_dim
        self.lora = cfg.q_lora_rank is not None
        if self.lora:
            self.q_a = nn.Linear(cfg.hidden_size, cfg.q_lora_rank, bias=cfg.attention_bias)
            self.q_a_norm = RMSNorm(cfg.q_lora_rank, _LATENT_NORM_EPS)
            self.q_b = nn.Linear(cfg.q_lora_rank, cfg.num_heads * qk, bias=False)
        else:
            self.q = nn.Linear(cfg.hidden_size, cfg.num_heads * qk, bias=False)
        self.kv_a = nn.Linear(cfg.hidden_size, self.rank + self.rope_dim, bias=cfg.attention_bias)
        self.kv_a_norm = RMSNorm(self.rank, _LATENT_NORM_EPS)
        # A parameter, not a Linear: its key and value halves multiply q and the output (absorbed) as
        # often as the latents (plain), and a packed CPU Linear (cpu_linear.py) would hide them.
        self.kv_b = nn.Parameter(torch.empty(cfg.num_heads * (self.nope + self.v_dim), self.rank))
        self.o = nn.Linear(cfg.num_heads * self.v_dim, cfg.hidden_size, bias=cfg.attention_bias)
        self.scale = cfg.softmax_scale
        self.sliding_window = None
        self.rope_interleave = cfg.rope_interleave

    def interleave_rotary_dims(self, rotary_dim: int) -> None:
        """Once, after loading: a rotate-half checkpoint's rotary rows (q's and kv_a's) in adjacent pairs."""
        if self.rope_interleave:
            return
        q = (self.q_b if self.lora else self.q).weight.data.view(self.num_heads, self.nope + self.rope_dim, -1)
        q[:, self.nope:] = interleave_rotary(q[:, self.nope:].reshape(-1, q.shape[-1]), self.num_heads,
                                             rotary_dim, rotary_dim).view(self.num_heads, rotary_dim, -1)
        for param in (p for p in (self.kv_a.weight, self.kv_a.bias) if p is not None):
            rows = param.data[self.rank:]
            rows.copy_(interleave_rotary(rows.clone(), 1, rotary_dim, rotary_dim))

    @functools.cached_property
    def layer_attention(self) -> LayerAttention:
        """As a kernel sees it: multi-query attention over one latent "head" (latent + rotary key)."""
        return LayerAttention(self.num_heads, 1, self.rank + self.rope_dim, self.scale, None, None)

    def forward(self, x, positions, rope, kv_cache, batch):
        tokens = x.shape[0]
        q = self.q_b(self.q_a_norm(self.q_a(x))) if self.lora else self.q(x)
        q_nope, q_pe = q.view(tokens, self.num_heads, -1).split([self.nope, self.rope_dim], dim=-1)
        latent, k_pe = self.kv_a(x).split([self.rank, self.rope_dim], dim=-1)
        q_pe, k_pe = rope(positions, q_pe.contiguous(), k_pe.contiguous().unsqueeze(1))
        latent = torch.cat([self.kv_a_norm(latent), k_pe.squeeze(1)], dim=-1)
        weights = LatentWeights(self.kv_b, self.num_heads, self.nope, self.v_dim)
        out = attend_latent(batch, q_nope, q_pe, latent, kv_cache, weights, self.scale)
        return self.tp.all_reduce(self.o(out.reshape(tokens, self.num_heads * self.v_dim)))


class DeepseekMoE(SparseMoE):
    """Routed experts (SparseMoE's, routed DeepSeek's way) plus shared experts every token runs."""

    def __init__(self, cfg: DeepseekConfig):
        super().__init__(cfg)
        self.scoring, self.scaling = cfg.scoring, cfg.routed_scaling_factor
        self.num_groups, self.groups_per_token = cfg.num_groups, cfg.groups_per_token
        if cfg.scoring == "sigmoid":
            self.correction_bias = nn.Parameter(torch.zeros(cfg.num_experts))
        self.shared = MLP(dataclasses.replace(cfg, intermediate_size=cfg.shared_expert_size)) \
            if cfg.shared_expert_size else None

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.router(x).float()
        sigmoid = self.scoring == "sigmoid"
        scores = logits.sigmoid() if sigmoid else logits.softmax(dim=-1)
        # V3 chooses by the biased scores but weighs by the plain ones.
        choice = scores + self.correction_bias.float() if sigmoid else scores
        if self.num_groups > 1:
            groups = choice.view(x.shape[0], self.num_groups, -1)
            group_scores = groups.topk(2, dim=-1).values.sum(dim=-1) if sigmoid else groups.amax(dim=-1)
            kept = torch.zeros_like(group_scores, dtype=torch.bool)
            kept.scatter_(1, group_scores.topk(self.groups_per_token, dim=-1).indices, True)
            dropped = ~kept.unsqueeze(-1).expand_as(groups).reshape_as(choice)
            choice = choice.masked_fill(dropped, float("-inf") if sigmoid else 0.0)
        chosen = choice.topk(self.top_k, dim=-1).indices
        weights = scores.gather(1, chosen)
        if self.normalize:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.scaling, chosen

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        routed = super().forward(x)
        return routed if self.shared is None else routed.add_(self.shared(x))


class DeepseekDecoderLayer(nn.Module):
    def __init__(self, cfg: DeepseekConfig, index: int):
        super().__init__()
        self.input_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attn = LatentAttention(cfg)
        self.post_attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = DeepseekMoE(cfg) if cfg.is_moe_layer(index) else MLP(cfg)

    def forward(self, x, positions, rope, kv_cache, batch):
        x = x.add_(self.attn(self.input_norm(x), positions, rope, kv_cache, batch))
        return x.add_(self.mlp(self.post_attn_norm(x)))


class DeepseekModel(LlamaModel):
    """Llama's frame with MLA layers; each layer's cache holds one latent per token (mla_attention.py).

    Tensor parallel: a rank runs some of the heads (q_b or q, kv_b and o split by head) and a slice of
    every MLP's and expert's width; q_a, kv_a and their norms are whole on every rank, so each rank
    computes and caches the whole latent: the latent is a KV "head" every rank holds (replicated, as
    KV heads are when ranks outnumber them), and a handoff sends it from the lowest rank to every rank."""

    layer_cls = DeepseekDecoderLayer
    latent_attention = True  # the runner attends with SDPA's step (mla_attention.py reads its tables)

    def __init__(self, cfg: DeepseekConfig, shard: TPShard = TPShard()):
        if shard.size > 1 and cfg.attention_bias:
            raise ValueError("tensor_parallel_size > 1 with attention_bias: o's bias would be summed over the ranks")
        super().__init__(cfg, shard)
        self.kv_heads_by_rank, self.total_kv_heads = ((0, 1),) * shard.size, 1  # one latent "head", on every rank

    @property
    def kv_cache_layout(self) -> tuple[int, int]:
        return 1, latent_page_width(self.cfg.kv_lora_rank, self.cfg.qk_rope_head_dim)

    @staticmethod
    def rank_slice(name: str, cfg: DeepseekConfig, shard: TPShard):
        """parallel.rank_slice for MLA's per-head weights and the shared experts; the rest as Llama's."""
        if shard.size == 1:
            return None
        h0, h1 = shard.split(cfg.num_heads)
        qk, kv = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim, cfg.qk_nope_head_dim + cfg.v_head_dim
        shared = cfg.shared_expert_size
        if name.endswith(("attn.q_b.weight", "attn.q.weight")):
            return 0, [(h0 * qk, h1 * qk)]
        if name.endswith("attn.kv_b"):
            return 0, [(h0 * kv, h1 * kv)]
        if name.endswith("attn.o.weight"):
            return 1, [(h0 * cfg.v_head_dim, h1 * cfg.v_head_dim)]
        if name.endswith("mlp.shared.gate_up.weight"):
            i0, i1 = shard.split(shared)
            return 0, [(i0, i1), (shared + i0, shared + i1)]
        if name.endswith("mlp.shared.down.weight"):
            return 1, [shard.split(shared)]
        return rank_slice(name, cfg, shard)

    def attach(self, comm: TPComm) -> None:
        super().attach(comm)
        for module in self.modules():
            if isinstance(module, LatentAttention):
                module.tp = comm
