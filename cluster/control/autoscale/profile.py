"""An engine profile: what one engine step costs on some hardware, and the limits the engine runs under.

The simulator asks a profile one question, `step_s(shape)`: how long does a step take that computes
this batch? A `BatchShape` summarises a batch the way its cost depends on it:

- prefill_tokens: prompt tokens computed in the step (whole prompts or chunks);
- prefill_pairs: query-key pairs of their causal attention, sum of n * c + n * (n + 1) / 2 for a chunk
  of n tokens after c already computed (attention grows with the square of the prompt);
- prefill_samples: prompts that finish in the step (each samples its first token: one lm_head row);
- decode_seqs: sequences computing one token each;
- decode_context: KV entries those decode tokens attend to, sum of (c + 1).

Two cost models answer it:

- "linear" (measured by `tandem plan profile`, see measure.py): a least-squares fit on real engine
  steps, t = base + per_token * prefill_tokens + per_pair * prefill_pairs + per_seq * decode_seqs
  + per_context_token * decode_context. Prefill-only and decode-only steps are fitted apart (each with
  its own base); a mixed step (chunked prefill next to decodes) pays the larger base once.
- "roofline" (roofline.py, for a named GPU and model size): a step is bound by compute or by memory,
  t = overhead + max(FLOPs / (peak_flops * mfu), bytes / (hbm_bytes_per_s * mbu)), where FLOPs count
  2 per weight per token plus attention, and bytes are the weights (read once per step) plus the KV read.

JSON format (`EngineProfile.to_json` / `from_json`), every time in seconds and every size in bytes:

    {
      "format": "tandem-profile/1",
      "source": "measured" | "roofline",
      "hardware": "free text: CPU model and threads, or the GPU name",
      "model": {"name": str, "num_params": int, "num_layers": int, "hidden_size": int, "num_heads": int,
                "num_kv_heads": int, "head_dim": int, "intermediate_size": int, "vocab_size": int,
                "dtype_bytes": int},
      "kv_bytes_per_token": int,          # K and V, all layers
      "transfer": {"bytes_per_s": float, "latency_s": float},   # KV handoff prefill -> decode
      "engine": {"block_size": int, "num_kv_blocks": int, "max_num_seqs": int,
                 "max_num_batched_tokens": int},
      "cost": {"kind": "linear",
               "prefill": {"base_s": f, "per_token_s": f, "per_pair_s": f},
               "decode": {"base_s": f, "per_seq_s": f, "per_context_token_s": f}}
            | {"kind": "roofline", "peak_flops": f, "hbm_bytes_per_s": f, "mfu": f, "mbu": f,
               "overhead_s": f},
      "samples": [...]                    # measured only: the raw step timings the fit used
    }
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

FORMAT = "tandem-profile/1"


@dataclass(frozen=True)
class BatchShape:
    prefill_tokens: int = 0
    prefill_pairs: int = 0
    prefill_samples: int = 0
    decode_seqs: int = 0
    decode_context: int = 0

    @property
    def empty(self) -> bool:
        return self.prefill_tokens == 0 and self.decode_seqs == 0


def chunk_pairs(n: int, computed: int) -> int:
    """Query-key pairs of causal attention for n new tokens after `computed` cached ones."""
    return n * computed + n * (n + 1) // 2


@dataclass(frozen=True)
class ModelShape:
    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    dtype_bytes: int = 2
    num_params: int = 0  # 0: derived from the shape (Llama layout, untied embeddings)
    # Multi-head latent attention (DeepSeek): the values a token caches a layer, one latent shared by every
    # head (kv_lora_rank + qk_rope_head_dim); 0: each KV head caches its K and V.
    kv_latent_dim: int = 0
    active_params: int = 0  # a mixture of experts: the parameters one token computes with; 0: num_params

    def __post_init__(self) -> None:
        for name in ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "head_dim", "intermediate_size",
                     "vocab_size", "dtype_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"model {self.name!r}: {name} must be positive, got {getattr(self, name)}")
        if self.num_params == 0:
            object.__setattr__(self, "num_params", self.layer_params * self.num_layers + 2 * self.vocab_size * self.hidden_size)

    @property
    def layer_params(self) -> int:
        h, q, kv = self.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        return h * (q + 2 * kv) + q * h + 3 * h * self.intermediate_size

    @property
    def kv_bytes_per_token(self) -> int:
        if self.kv_latent_dim:
            return self.num_layers * self.kv_latent_dim * self.dtype_bytes
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype_bytes

    @property
    def token_params(self) -> int:
        """The weights one token multiplies through, the embedding and the LM head aside."""
        if self.active_params:
            return self.active_params - 2 * self.vocab_size * self.hidden_size
        return self.layer_params * self.num_layers

    @classmethod
    def from_hf_config(cls, name: str, hf: dict, dtype_bytes: int = 2) -> "ModelShape":
        try:
            if hf.get("model_type") == "llama4_text":
                return cls._llama4(name, hf, dtype_bytes)
            heads = hf["num_attention_heads"]
            latent = hf["kv_lora_rank"] + hf["qk_rope_head_dim"] if hf.get("kv_lora_rank") else 0
            return cls(name=name, num_layers=hf["num_hidden_layers"], hidden_size=hf["hidden_size"], num_heads=heads,
                       num_kv_heads=hf.get("num_key_value_heads") or heads,
                       head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
                       intermediate_size=hf["intermediate_size"], vocab_size=hf["vocab_size"], dtype_bytes=dtype_bytes,
                       kv_latent_dim=latent)
        except KeyError as exc:
            raise ValueError(f"config.json of {name!r} lacks {exc.args[0]!r}") from None

    @classmethod
    def _llama4(cls, name: str, hf: dict, dtype_bytes: int) -> "ModelShape":
        """Llama 4 text: MoE layers (1 routed + 1 shared expert a token, all experts held) among dense ones.
        intermediate_size becomes the MLP width a token runs, averaged over the layers (the FLOPs);
        num_params counts every expert (the memory)."""
        n, h, width, dense_width = (hf["num_hidden_layers"], hf["hidden_size"], hf["intermediate_size"],
                                    hf["intermediate_size_mlp"])
        experts, top_k = hf["num_local_experts"], hf.get("num_experts_per_tok", 1)
        step = hf.get("interleave_moe_layer_step", 1)
        moe = len(hf["moe_layers"] if hf.get("moe_layers") is not None else range(step - 1, n, step))
        heads, kv_heads = hf["num_attention_heads"], hf.get("num_key_value_heads") or hf["num_attention_heads"]
        head_dim = hf.get("head_dim") or h // heads
        attention = h * (heads + 2 * kv_heads) * head_dim + heads * head_dim * h
        mlps = moe * (h * experts + (experts + 1) * 3 * h * width) + (n - moe) * 3 * h * dense_width
        return cls(name=name, num_layers=n, hidden_size=h, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
                   intermediate_size=(moe * (top_k + 1) * width + (n - moe) * dense_width) // n,
                   vocab_size=hf["vocab_size"], dtype_bytes=dtype_bytes,
                   num_params=n * (attention + 2 * h) + mlps + 2 * hf["vocab_size"] * h + h)


@dataclass(frozen=True)
class EngineLimits:
    block_size: int = 16
    num_kv_blocks: int = 4096
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"engine limit {name}={value!r}: must be a positive integer")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(f"max_num_batched_tokens={self.max_num_batched_tokens} is below max_num_seqs="
                             f"{self.max_num_seqs}: every running decode must fit in one step's token budget")

    @classmethod
    def from_config(cls, config, num_kv_blocks: int | None = None) -> "EngineLimits":
        """The engine section of a `TandemConfig`; `num_kv_blocks` is needed when the config sizes the cache in GB."""
        e = config.engine
        blocks = e.num_kv_blocks or num_kv_blocks
        if blocks is None:
            raise ValueError("the config sizes the KV cache in GB (engine.num_kv_blocks is null): pass num_kv_blocks")
        return cls(e.block_size, blocks, e.max_num_seqs, e.max_num_batched_tokens)


@dataclass(frozen=True)
class LinearCost:
    prefill_base_s: float
    prefill_per_token_s: float
    prefill_per_pair_s: float
    decode_base_s: float
    decode_per_seq_s: float
    decode_per_context_token_s: float

    def step_s(self, s: BatchShape, model: ModelShape) -> float:
        t = 0.0
        if s.prefill_tokens:
            t += self.prefill_per_token_s * s.prefill_tokens + self.prefill_per_pair_s * s.prefill_pairs
        if s.decode_seqs:
            t += self.decode_per_seq_s * s.decode_seqs + self.decode_per_context_token_s * s.decode_context
        bases = ([self.prefill_base_s] if s.prefill_tokens else []) + ([self.decode_base_s] if s.decode_seqs else [])
        return t + max(bases, default=0.0)

    @classmethod
    def from_json(cls, cost: dict) -> "LinearCost":
        p, d = cost["prefill"], cost["decode"]
        return cls(p["base_s"], p["per_token_s"], p["per_pair_s"], d["base_s"], d["per_seq_s"], d["per_context_token_s"])

    def to_json(self) -> dict:
        return {"kind": "linear",
                "prefill": {"base_s": self.prefill_base_s, "per_token_s": self.prefill_per_token_s,
                            "per_pair_s": self.prefill_per_pair_s},
                "decode": {"base_s": self.decode_base_s, "per_seq_s": self.decode_per_seq_s,
                           "per_context_token_s": self.decode_per_context_token_s}}


@dataclass(frozen=True)
class RooflineCost:
    peak_flops: float  # of the whole worker (every rank)
    hbm_bytes_per_s: float
    mfu: float = 0.5
    mbu: float = 0.7
    overhead_s: float = 0.0
    # Tensor parallelism: each rank does 1/tp of the FLOPs and bytes above, then the ranks all-reduce the
    # activations twice per layer (after attention's o and the MLP's down), not overlapped with compute.
    tensor_parallel: int = 1
    link_bytes_per_s: float = 0.0  # one direction of a rank's link to the others (NVLink, PCIe)
    link_latency_s: float = 0.0  # per all-reduce

    def allreduce_s(self, s: BatchShape, model: ModelShape) -> float:
        """A ring all-reduce moves 2 (tp - 1) / tp of the activations through each rank's link."""
        if self.tensor_parallel == 1:
            return 0.0
        tp = self.tensor_parallel
        activation_bytes = (s.prefill_tokens + s.decode_seqs) * model.hidden_size * model.dtype_bytes
        one = 2 * (tp - 1) / tp * activation_bytes / self.link_bytes_per_s + self.link_latency_s
        return 2 * model.num_layers * one

    def step_s(self, s: BatchShape, model: ModelShape) -> float:
        tokens = s.prefill_tokens + s.decode_seqs
        linear = 2 * model.token_params * tokens
        lm_head = 2 * model.hidden_size * model.vocab_size * (s.prefill_samples + s.decode_seqs)
        # QK^T and PV: 2 FLOPs each per query-key pair per query head dimension, in every layer.
        attention = 4 * model.num_layers * model.num_heads * model.head_dim * (s.prefill_pairs + s.decode_context)
        weight_bytes = model.num_params * model.dtype_bytes
        kv_bytes = model.kv_bytes_per_token * (s.decode_context + s.prefill_tokens)
        compute = (linear + lm_head + attention) / (self.peak_flops * self.mfu)
        memory = (weight_bytes + kv_bytes) / (self.hbm_bytes_per_s * self.mbu)
        return self.overhead_s + max(compute, memory) + self.allreduce_s(s, model)

    def to_json(self) -> dict:
        return {"kind": "roofline", **asdict(self)}


@dataclass(frozen=True)
class EngineProfile:
    source: str
    hardware: str
    model: ModelShape
    cost: LinearCost | RooflineCost
    engine: EngineLimits = EngineLimits()
    transfer_bytes_per_s: float = 2e9
    transfer_latency_s: float = 0.0
    samples: list = field(default_factory=list, compare=False)

    def __post_init__(self) -> None:
        if self.transfer_bytes_per_s <= 0 or self.transfer_latency_s < 0:
            raise ValueError(f"profile transfer: bytes_per_s must be > 0 and latency_s >= 0, got "
                             f"{self.transfer_bytes_per_s} and {self.transfer_latency_s}")

    @property
    def kv_bytes_per_token(self) -> int:
        return self.model.kv_bytes_per_token

    def step_s(self, shape: BatchShape) -> float:
        return self.cost.step_s(shape, self.model)

    def transfer_s(self, prompt_tokens: int) -> float:
        return self.transfer_latency_s + prompt_tokens * self.kv_bytes_per_token / self.transfer_bytes_per_s

    def prefill_s(self, prompt_tokens: int) -> float:
        """One prompt alone, in chunks of the token budget (what it costs with nothing else queued)."""
        total, done, budget = 0.0, 0, self.engine.max_num_batched_tokens
        while done < prompt_tokens:
            n = min(budget, prompt_tokens - done)
            last = done + n == prompt_tokens
            total += self.step_s(BatchShape(n, chunk_pairs(n, done), int(last)))
            done += n
        return total

    def to_json(self) -> dict:
        return {"format": FORMAT, "source": self.source, "hardware": self.hardware, "model": asdict(self.model),
                "kv_bytes_per_token": self.kv_bytes_per_token,
                "transfer": {"bytes_per_s": self.transfer_bytes_per_s, "latency_s": self.transfer_latency_s},
                "engine": asdict(self.engine), "cost": self.cost.to_json(), "samples": self.samples}

    @classmethod
    def from_json(cls, data: dict) -> "EngineProfile":
        if data.get("format") != FORMAT:
            raise ValueError(f"not a tandem profile: format is {data.get('format')!r}, expected {FORMAT!r}")
        try:
            cost = data["cost"]
            if cost["kind"] == "linear":
                model_cost = LinearCost.from_json(cost)
            elif cost["kind"] == "roofline":
                model_cost = RooflineCost(**{k: v for k, v in cost.items() if k != "kind"})
            else:
                raise ValueError(f"unknown cost model kind {cost['kind']!r} (linear or roofline)")
            return cls(source=data["source"], hardware=data["hardware"], model=ModelShape(**data["model"]),
                       cost=model_cost, engine=EngineLimits(**data["engine"]),
                       transfer_bytes_per_s=data["transfer"]["bytes_per_s"],
                       transfer_latency_s=data["transfer"]["latency_s"], samples=data.get("samples", []))
        except (KeyError, TypeError) as exc:
            raise ValueError(f"profile is missing or has a bad field: {exc}") from None

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> "EngineProfile":
        path = Path(path)
        if not path.is_file():
            raise ValueError(f"profile {path} does not exist (make one with `tandem plan profile --out {path}`)")
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise ValueError(f"profile {path} is not JSON: {exc}") from None
        return cls.from_json(data)
