"""The embedded default model: a tiny random Llama, built deterministically in Hugging Face format.

No model hub is needed anywhere: on first use the weights are drawn from a fixed seed, written as a
normal checkpoint directory (config.json, model.safetensors, tokenizer files) under the cache, and
then loaded through the same loader as any real checkpoint. Its text is random; it exists so that
every command and test runs on a fresh machine.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable

import torch
from safetensors.torch import save_file

from actors.engine.text.tokenizer import DEFAULT_TOKENIZER_DIR

DEFAULT_MODEL = "builtin:tiny-llama"
_VERSION = "v1"  # bump when the recipe below changes, so old caches are not reused

_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 2048,
    "hidden_size": 128,
    "intermediate_size": 384,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
    "initializer_range": 0.05,
}
_SEED = 20261130


def cache_root() -> Path:
    return Path(os.environ.get("TANDEM_CACHE", Path.home() / ".cache" / "tandem"))


def resolve_model(model: str | None) -> str:
    """A model argument as a checkpoint directory: None or the builtin name give the default model."""
    if model is None or model == DEFAULT_MODEL:
        return str(ensure_default_model())
    if model.startswith("builtin:"):
        raise ValueError(f"unknown builtin model {model!r}; the only one is {DEFAULT_MODEL!r}")
    return model


def ensure_default_model() -> Path:
    return build_cached(f"tiny-llama-{_VERSION}", _write_checkpoint)


def ensure_on_this_node(model_dir: str) -> None:
    """The driver resolved the default model to a path in its node's cache; a worker on another node
    builds the same seeded checkpoint at that path (any other directory must be there already)."""
    path = Path(model_dir)
    if path.name == f"tiny-llama-{_VERSION}" and path.parent.name == "models":
        _build_into(path, _write_checkpoint)


def build_cached(name: str, write: Callable[[Path], None]) -> Path:
    """A checkpoint built on first use under the cache: `write` fills a staging directory that is then
    renamed into place, so a concurrent builder either wins or finds it done."""
    return _build_into(cache_root() / "models" / name, write)


def _build_into(target: Path, write: Callable[[Path], None]) -> Path:
    if (target / "model.safetensors").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=target.parent, prefix=".building-"))
    try:
        write(staging)
        try:
            staging.rename(target)
        except OSError:
            if not (target / "model.safetensors").is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def build_random_llama(name: str, **config) -> Path:
    """A random `transformers` Llama of the given shape (seed 0, untied embeddings, no tokenizer)."""
    def write(out: Path) -> None:
        import transformers

        torch.manual_seed(0)
        transformers.LlamaForCausalLM(transformers.LlamaConfig(**config, tie_word_embeddings=False)).save_pretrained(out)

    return build_cached(name, write)


def _write_checkpoint(out: Path) -> None:
    for f in DEFAULT_TOKENIZER_DIR.iterdir():
        if f.suffix == ".json":
            shutil.copy(f, out / f.name)
    tok = json.loads((out / "tokenizer.json").read_text())
    special = {t["content"]: t["id"] for t in tok["added_tokens"]}
    eos = [special["<|end_of_text|>"], special["<|end|>"]]  # a chat turn ends with <|end|>
    config = {**_CONFIG, "bos_token_id": special["<|begin_of_text|>"], "eos_token_id": eos}
    (out / "config.json").write_text(json.dumps(config, indent=2))
    (out / "generation_config.json").write_text(
        json.dumps({"bos_token_id": config["bos_token_id"], "eos_token_id": eos}, indent=2)
    )
    save_file(_random_weights(config), str(out / "model.safetensors"), metadata={"format": "pt"})


def _random_weights(c: dict) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(_SEED)
    std = c["initializer_range"]
    h, inter, v = c["hidden_size"], c["intermediate_size"], c["vocab_size"]
    head_dim = h // c["num_attention_heads"]
    kv = c["num_key_value_heads"] * head_dim

    def normal(*shape):
        return torch.randn(*shape, generator=g) * std

    w = {"model.embed_tokens.weight": normal(v, h)}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        w[p + "self_attn.q_proj.weight"] = normal(h, h)
        w[p + "self_attn.k_proj.weight"] = normal(kv, h)
        w[p + "self_attn.v_proj.weight"] = normal(kv, h)
        w[p + "self_attn.o_proj.weight"] = normal(h, h)
        w[p + "mlp.gate_proj.weight"] = normal(inter, h)
        w[p + "mlp.up_proj.weight"] = normal(inter, h)
        w[p + "mlp.down_proj.weight"] = normal(h, inter)
        w[p + "input_layernorm.weight"] = torch.ones(h)
        w[p + "post_attention_layernorm.weight"] = torch.ones(h)
    w["model.norm.weight"] = torch.ones(h)
    w["lm_head.weight"] = normal(v, h)
    return w
