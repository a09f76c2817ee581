"""Hot-path engine configuration: a frozen dataclass, validated once when the engine starts."""

from __future__ import annotations

from dataclasses import dataclass

from actors.engine.model.dtype_choice import DTYPE_NAMES


@dataclass(frozen=True)
class EngineConfig:
    model: str  # Hugging Face checkpoint directory
    model_source: str | None = None  # what `model` was resolved from (builtin name, GGUF file), if anything
    dtype: str = "float32"  # or bfloat16, float16, auto (dtype_choice.py); float32 here: exact parity by default
    device: str = "cpu"
    block_size: int = 16
    num_kv_blocks: int | None = None  # None: derive from kv_cache_memory_bytes
    kv_cache_memory_bytes: int = 1 << 30
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    seed: int = 0  # seeds the generator shared by unseeded requests
    model_id: str | None = None  # part of the first block's hash; None: the model directory's name
    detokenize: bool = True  # False: token ids only; text and stop strings are the caller's (the ingress)
    tenant_slowdown: float | None = 2.0  # several tenants share a step: its cost cap x a one-token step's
    step_budget_ms: float | None = None  # a step with decodes: its prompt tokens cut to this measured time (batcher.py)
    grammar_ms_per_token: float = 1.0  # a sequence's structured-output matcher time per token (structured.py)
    attention_backend: str = "auto"  # "sdpa", "cpu", "flashinfer", "triton" or "auto" (backend_choice.py)
    cuda_graphs: bool = True  # decode steps from CUDA graphs where they can run (decode_graphs.py)
    fused_kernels: bool = True  # RMSNorm, rope, silu-and-mul as Triton kernels on CUDA (triton_fused.py)
    overlap_steps: bool | None = None  # launch step N+1 before reading step N back (in_flight.py); None: on CUDA

    def __post_init__(self) -> None:
        positive = ("block_size", "max_num_seqs", "max_num_batched_tokens", "kv_cache_memory_bytes")
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"engine config {name}={value!r}: must be a positive integer")
        if self.dtype not in DTYPE_NAMES:
            raise ValueError(f"engine config dtype={self.dtype!r}: must be one of {', '.join(DTYPE_NAMES)}")
        if self.tenant_slowdown is not None and not self.tenant_slowdown > 1.0:
            raise ValueError(f"engine config tenant_slowdown={self.tenant_slowdown!r}: must be above 1 or null")
        if self.step_budget_ms is not None and not self.step_budget_ms > 0:
            raise ValueError(f"engine config step_budget_ms={self.step_budget_ms!r}: must be positive or null")
        if not self.grammar_ms_per_token > 0:
            raise ValueError(f"engine config grammar_ms_per_token={self.grammar_ms_per_token!r}: must be positive")
        if self.attention_backend not in ("auto", "sdpa", "cpu", "flashinfer", "triton"):
            raise ValueError(f"engine config attention_backend={self.attention_backend!r}: must be auto, sdpa, "
                             "cpu, flashinfer or triton")
        for name in ("num_kv_blocks", "max_model_len"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"engine config {name}={value!r}: must be a positive integer or null")
