"""User-facing configuration (YAML -> pydantic). A typo or a bad value fails at load, naming the field.

The engine's hot path never reads these models: `engine_config()` derives the frozen `EngineConfig`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from actors.engine_config import EngineConfig
from actors.models.default_model import DEFAULT_MODEL, resolve_model


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelSection(_Strict):
    path: str = Field(DEFAULT_MODEL, description=f"Hugging Face checkpoint directory, or {DEFAULT_MODEL!r} for the embedded tiny model")
    dtype: Literal["float32", "bfloat16", "float16"] = Field("float32", description="weight and KV cache dtype")
    max_model_len: int | None = Field(None, gt=0, description="context length; null uses the model's max_position_embeddings")


class EngineSection(_Strict):
    block_size: int = Field(16, gt=0, description="tokens per KV block")
    num_kv_blocks: int | None = Field(None, gt=0, description="KV blocks per worker; null sizes the cache from kv_cache_memory_gb")
    kv_cache_memory_gb: float = Field(1.0, gt=0, description="KV cache size per worker when num_kv_blocks is null")
    max_num_seqs: int = Field(64, gt=0, description="most sequences in one engine step")
    max_num_batched_tokens: int = Field(2048, gt=0, description="token budget of one engine step")
    enable_prefix_caching: bool = Field(True, description="reuse KV blocks of identical prompt prefixes")
    enable_chunked_prefill: bool = Field(True, description="split long prompts into chunks that share steps with decodes")
    seed: int = Field(0, description="seed of the generator shared by unseeded requests")


class TandemConfig(_Strict):
    model: ModelSection = Field(default_factory=ModelSection, description="which model to serve")
    engine: EngineSection = Field(default_factory=EngineSection, description="per-worker engine limits")

    @classmethod
    def from_file(cls, path: str | Path) -> "TandemConfig":
        path = Path(path)
        if not path.is_file():
            raise ValueError(f"config file {path} does not exist")
        data = yaml.safe_load(path.read_text()) or {}
        if not isinstance(data, dict):
            raise ValueError(f"{path}: the top level must be a mapping of sections")
        try:
            return cls.model_validate(data)
        except ValidationError as exc:
            problems = "; ".join(f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors())
            raise ValueError(f"{path}: {problems}") from None

    def engine_config(self) -> EngineConfig:
        e = self.engine
        return EngineConfig(
            model=resolve_model(self.model.path),
            dtype=self.model.dtype,
            max_model_len=self.model.max_model_len,
            block_size=e.block_size,
            num_kv_blocks=e.num_kv_blocks,
            kv_cache_memory_bytes=int(e.kv_cache_memory_gb * (1 << 30)),
            max_num_seqs=e.max_num_seqs,
            max_num_batched_tokens=e.max_num_batched_tokens,
            enable_prefix_caching=e.enable_prefix_caching,
            enable_chunked_prefill=e.enable_chunked_prefill,
            seed=e.seed,
        )
