"""The Llama family decoder (Llama 2/3, Mistral; Qwen2 adds a qkv bias, Qwen3 a per-head RMSNorm on q and
k before the rotary embedding; Phi-3 rotates part of each head with longrope; Mixtral and Qwen3-MoE route
each token to a few experts) over a paged KV cache.

Weights use fused projections (qkv, gate_up): fewer, larger matmuls per layer. The loader maps
Hugging Face checkpoint names onto them; `forward` never sees checkpoint names. On CUDA the norm, the
rotary embedding and silu-and-mul may run as fused Triton kernels (`use_fused_kernels`).

Over 300 lines because it is the whole family in one file, as STYLE.md asks of a model (config, norm,
attention, MLP, layer, model), and the frame the Gemma decoders build on.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from actors.engine.model.attention_backend import LayerAttention, StepAttention
from actors.engine.model.moe import SparseMoE
from actors.engine.model.parallel import SINGLE, TPComm, TPShard, rank_slice
from actors.engine.model.rope import RopeSpec, RotaryEmbedding, interleave_rotary, read_rope_parameters


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
    rope_scaling: dict | None  # HF rope parameters for non-default rope types (llama3, linear, longrope)
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    sliding_windows: tuple[int | None, ...]  # per layer; None = full attention
    qk_norm: bool = False  # Qwen3: RMSNorm over each head of q and k
    partial_rotary_factor: float = 1.0  # Phi-3/4: the share of each head's dims that rotate
    local_rope_theta: float | None = None  # Gemma 3: the sliding layers' own (unscaled) rope base
    # Mixture of experts (Mixtral, Qwen3-MoE); num_experts == 0: every layer has a dense MLP.
    num_experts: int = 0
    experts_per_token: int = 0
    expert_intermediate_size: int = 0
    normalize_expert_weights: bool = True  # rescale the top-k router weights to sum to 1
    dense_layers: tuple[int, ...] = ()  # layers of an MoE model that keep a dense MLP

    @classmethod
    def from_hf(cls, hf: dict) -> "LlamaConfig":
        """Read a Hugging Face config.json dict (old `rope_scaling`/`rope_theta` or new `rope_parameters`)."""
        missing = [k for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                               "num_attention_heads") if k not in hf]
        if missing:
            raise ValueError(f"config.json has no {', '.join(repr(k) for k in missing)}")
        num_heads = hf["num_attention_heads"]
        rope_theta, rope_scaling = read_rope_parameters(hf)
        num_layers = hf["num_hidden_layers"]
        model_type = hf.get("model_type", "llama")
        window = hf.get("sliding_window")
        if model_type in ("qwen2", "qwen3", "qwen3_moe") and not hf.get("use_sliding_window", False):
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
            rope_scaling=rope_scaling,
            max_position_embeddings=hf.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention_bias=bool(hf.get("attention_bias", model_type == "qwen2")),
            sliding_windows=windows,
            qk_norm=model_type in ("qwen3", "qwen3_moe"),
            partial_rotary_factor=float((hf.get("rope_parameters") or {}).get(
                "partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))),
            **_experts(hf, model_type, num_layers),
        )

    def is_moe_layer(self, index: int) -> bool:
        return self.num_experts > 0 and index not in self.dense_layers

    def rope_spec(self, local: bool = False) -> RopeSpec:
        """The rope of the full-attention layers, or (`local`) of Gemma 3's sliding ones."""
        theta, scaling = (self.local_rope_theta, None) if local else (self.rope_theta, self.rope_scaling)
        return RopeSpec(theta, scaling, int(self.head_dim * self.partial_rotary_factor), self.max_position_embeddings)


def _experts(hf: dict, model_type: str, num_layers: int) -> dict:
    """The MoE fields of a Mixtral (every layer top-k of `num_local_experts`, weights renormalized) or a
    Qwen3-MoE (`num_experts`, `moe_intermediate_size`, `norm_topk_prob`, some layers dense)."""
    if model_type not in ("mixtral", "qwen3_moe"):
        return {}
    missing = [k for k in ("num_experts_per_tok",) if k not in hf]
    if not (hf.get("num_local_experts") or hf.get("num_experts")):
        missing.append("num_local_experts" if model_type == "mixtral" else "num_experts")
    if model_type == "qwen3_moe" and "moe_intermediate_size" not in hf:
        missing.append("moe_intermediate_size")
    if missing:
        raise ValueError(f"config.json has no {', '.join(repr(k) for k in missing)}")
    fields = dict(num_experts=hf.get("num_local_experts") or hf["num_experts"],
                  experts_per_token=hf["num_experts_per_tok"])
    if model_type == "mixtral":
        return {**fields, "expert_intermediate_size": hf["intermediate_size"]}
    step = hf.get("decoder_sparse_step", 1)
    dense = set(hf.get("mlp_only_layers") or ()) | {i for i in range(num_layers) if (i + 1) % step}
    return {**fields, "expert_intermediate_size": hf["moe_intermediate_size"],
            "normalize_expert_weights": bool(hf.get("norm_topk_prob", False)), "dense_layers": tuple(sorted(dense))}


def normalized(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / RMS(x) in float32. The sum of squares comes from one reduction (vector_norm) rather than
    squaring every element into a temporary first: at prefill sizes that temporary cost more than the
    norm's arithmetic."""
    h = x.float()
    mean_square = torch.linalg.vector_norm(h, dim=-1, keepdim=True).square_().div_(h.shape[-1])
    return h * mean_square.add_(eps).rsqrt_()


class RMSNorm(nn.Module):
    fused = None  # triton_fused when the model runs its fused kernels (LlamaModel.use_fused_kernels)

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused is not None:
            return self.fused.rms_norm(x, self.weight, self.eps)
        return normalized(x, self.eps).to(x.dtype).mul_(self.weight)


class Attention(nn.Module):
    qk_norm_cls = RMSNorm
    tp: TPComm = SINGLE  # a tensor-parallel rank's group (LlamaModel.attach): o's partial sums are all-reduced
    fused = None  # triton_fused: q and k rotate in place in the qkv output, one kernel for both

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
            self.q_norm = self.qk_norm_cls(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = self.qk_norm_cls(cfg.head_dim, cfg.rms_norm_eps)
        self.qk_norm = cfg.qk_norm

    def interleave_rotary_dims(self, rotary_dim: int) -> None:
        """Once, after loading: q and k in RotaryEmbedding's pair layout (rope.py)."""
        def turned(rows: torch.Tensor, heads: int) -> torch.Tensor:
            return interleave_rotary(rows, heads, self.head_dim, rotary_dim)

        for param in (p for p in (self.qkv.weight, self.qkv.bias) if p is not None):
            q, k = param.data[: self.q_size], param.data[self.q_size : self.q_size + self.kv_size]
            q.copy_(turned(q, self.num_heads))
            k.copy_(turned(k, self.num_kv_heads))
        if self.qk_norm:
            for norm in (self.q_norm, self.k_norm):
                norm.weight.data.copy_(turned(norm.weight.data, 1))

    @functools.cached_property
    def layer_attention(self) -> LayerAttention:
        """Built on first use (after a subclass's __init__ has set its scale and cap), then reused by every step."""
        return LayerAttention(self.num_heads, self.num_kv_heads, self.head_dim, self.scale, self.sliding_window,
                              self.softcap)

    def forward(self, x, positions, rope: RotaryEmbedding, kv_cache, batch: StepAttention):
        qkv = self.qkv(x)
        turn_in_place = self.fused is not None and not self.qk_norm
        if turn_in_place:
            heads = qkv[:, : self.q_size + self.kv_size].view(-1, self.num_heads + self.num_kv_heads, self.head_dim)
            self.fused.rotate_pairs_(heads, rope.turns, positions)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        if not turn_in_place:
            q, k = rope(positions, q, k)
        out = batch.attend(q, k, v, kv_cache[0], kv_cache[1], self.layer_attention)
        return self.tp.all_reduce(self.o(out.reshape(-1, self.q_size)))


_MLP_ROWS_PER_PASS = 1024


class MLP(nn.Module):
    tp: TPComm = SINGLE
    fused = None  # triton_fused: silu(gate) * up in one kernel (only where `act` is silu)

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.gate_up = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x):
        if x.shape[0] <= _MLP_ROWS_PER_PASS:
            return self._forward(x)
        # A prefill's gate/up activations (tokens x 2 x intermediate) outgrow the caches: row blocks keep
        # them cache-sized (the GEMMs ran ~20% faster on 1024-row blocks than on 8192 rows here). Each
        # row's result is the same bits whatever block it is in (cpu_linear.py's packed GEMM).
        out = x.new_empty(x.shape[0], self.down.out_features)
        for start in range(0, x.shape[0], _MLP_ROWS_PER_PASS):
            rows = slice(start, start + _MLP_ROWS_PER_PASS)
            out[rows] = self._forward(x[rows])
        return out

    def _forward(self, x):
        gate_up = self.gate_up(x)
        if self.fused is not None:
            return self.tp.all_reduce(self.down(self.fused.silu_and_mul(gate_up)))
        gate, up = gate_up.chunk(2, dim=-1)
        return self.tp.all_reduce(self.down(self.act(gate).mul_(up)))

    def act(self, gate: torch.Tensor) -> torch.Tensor:
        return F.silu(gate)


class DecoderLayer(nn.Module):
    attn_cls, moe_cls = Attention, SparseMoE  # a family's own attention or experts (gpt_oss.py)

    def __init__(self, cfg: LlamaConfig, index: int):
        super().__init__()
        self.input_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attn = self.attn_cls(cfg, cfg.sliding_windows[index])
        self.post_attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = self.moe_cls(cfg) if cfg.is_moe_layer(index) else MLP(cfg)

    def forward(self, x, positions, rope, kv_cache, batch):
        # In place: x is this layer's own (the embedding's or the previous layer's output).
        x = x.add_(self.attn(self.input_norm(x), positions, rope, kv_cache, batch))
        return x.add_(self.mlp(self.post_attn_norm(x)))


class LlamaModel(nn.Module):
    """Also the frame of the other decoders (gemma.py): they change the layer, the norm, and what happens to
    the embeddings and the logits (`embed`, `final_logits`)."""

    layer_cls = DecoderLayer
    norm_cls = RMSNorm

    def __init__(self, cfg: LlamaConfig, shard: TPShard = TPShard()):
        """`shard`: the tensor-parallel rank this model is (its heads, MLP widths and vocabulary rows;
        `cfg` becomes that rank's config)."""
        super().__init__()
        self.shard = shard
        # Which of the model's KV heads each rank's cache holds ([first, end)), and how many there are.
        self.kv_heads_by_rank = tuple(TPShard(r, shard.size).kv_heads(cfg.num_kv_heads, cfg.num_heads)
                                      for r in range(shard.size))
        self.total_kv_heads = cfg.num_kv_heads
        self.cfg = cfg = shard.local_config(cfg)
        self.tp: TPComm = SINGLE
        self.vocab_rows = shard.vocab(cfg.vocab_size)
        rows = self.vocab_rows[1] - self.vocab_rows[0]
        # Given its weight, the embedding skips its random init: a normal_ on the meta device the loader
        # builds on imports torch._dynamo, 1-3 s of every worker's start (and of every restart).
        self.embed_tokens = nn.Embedding(rows, cfg.hidden_size, _weight=torch.empty(rows, cfg.hidden_size))
        self.layers = nn.ModuleList(self.layer_cls(cfg, i) for i in range(cfg.num_layers))
        self.norm = self.norm_cls(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, rows, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.build_ropes(cfg.max_position_embeddings)

    def build_ropes(self, context_len: int, device: torch.device | str | None = None) -> None:
        """(Re)build the cos/sin tables for `context_len` positions (the engine's max_model_len), on
        `device` (None: the current default, e.g. meta while a checkpoint is being loaded)."""
        self.rope = RotaryEmbedding(self.cfg.rope_spec(), context_len).to(device)
        self.local_rope = None
        if self.cfg.local_rope_theta is not None:
            self.local_rope = RotaryEmbedding(self.cfg.rope_spec(local=True), context_len).to(device)

    @staticmethod
    def rank_slice(name: str, cfg: LlamaConfig, shard: TPShard):
        """Which slice of parameter `name` a rank of `shard` loads (parallel.rank_slice); None: all of it."""
        return rank_slice(name, cfg, shard)

    @property
    def kv_cache_layout(self) -> tuple[int, int]:
        """(heads, head_dim) of each layer's K and of its V cache tensor, per token."""
        return self.cfg.num_kv_heads, self.cfg.head_dim

    def interleave_rotary_dims(self) -> None:
        """Once, after the weights are loaded: every layer's q and k in the rope's pair layout (rope.py)."""
        for layer in self.layers:
            layer.attn.interleave_rotary_dims(self.cfg.rope_spec().rotary_dim)

    def attach(self, comm: TPComm) -> None:
        """Run as a rank of `comm`'s group: every module that all-reduces uses it."""
        if comm.shard != self.shard:
            raise ValueError(f"a model loaded as {self.shard} cannot run as {comm.shard}")
        self.tp = comm
        for module in self.modules():
            if isinstance(module, (Attention, MLP, SparseMoE)):
                module.tp = comm

    def layer_attentions(self) -> tuple[LayerAttention, ...]:
        """The distinct attention layers (heads, scale, window, cap): a backend plans each once per step."""
        return tuple(dict.fromkeys(layer.attn.layer_attention for layer in self.layers))

    def use_fused_kernels(self, kernels) -> None:
        """Run Llama's RMSNorm, the rotary embedding and silu-and-mul with `kernels` (triton_fused; None: the
        torch ops). Subclasses' own norms and activations (Gemma's) keep their torch ops."""
        for module in self.modules():
            if type(module) is RMSNorm or isinstance(module, Attention) or (
                    isinstance(module, MLP) and type(module).act is MLP.act):
                module.fused = kernels

    @property
    def windows(self) -> tuple[int | None, ...]:
        """The distinct attention windows of the layers (None: full attention): a step builds a mask for each."""
        return tuple(dict.fromkeys(self.cfg.sliding_windows))

    def forward(
        self,
        input_ids: torch.Tensor,
        batch: StepAttention,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        sample_idx: torch.Tensor,
    ) -> torch.Tensor:
        """Run the flat batch; return float32 logits only for the rows in `sample_idx`."""
        x = self.embed(input_ids)
        for layer, kv in zip(self.layers, kv_caches):
            local = self.local_rope is not None and layer.attn.sliding_window is not None
            x = layer(x, batch.positions, self.local_rope if local else self.rope, kv, batch)
        x = self.norm(x[sample_idx])
        logits = self.tp.gather_vocab(self.lm_head(x).float(), self.cfg.vocab_size)
        return self.final_logits(logits)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.shard.size == 1:
            return self.embed_tokens(input_ids)
        # Each rank holds some rows of the vocabulary: the others' tokens embed to zeros, then the ranks sum.
        first, end = self.vocab_rows
        inside = (input_ids >= first) & (input_ids < end)
        x = self.embed_tokens((input_ids - first).clamp(0, end - first - 1)) * inside[:, None].to(self.embed_tokens.weight.dtype)
        return self.tp.all_reduce(x)

    def final_logits(self, logits: torch.Tensor) -> torch.Tensor:
        return logits
