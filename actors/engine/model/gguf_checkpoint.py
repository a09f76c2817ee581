"""A GGUF file as a Hugging Face checkpoint directory that the loader reads like any other.

The `gguf` package (llama.cpp's reference reader) parses the file and de-quantizes every tensor to
float32; this module only renames: GGUF metadata keys -> config.json, GGUF tensor names -> checkpoint
names, and it undoes the one layout change llama.cpp's converter makes for the `llama` architecture
(the rows of q and k are interleaved per head for its rotary embedding; Hugging Face keeps them in
two halves). The tokenizer and its chat template come from the file's metadata through transformers'
GGUF tokenizer reader, saved as tokenizer.json + tokenizer_config.json.

The converted directory is cached under the model cache (built in a staging directory, then renamed
into place) and keyed by the file's content hash, so a second start skips the conversion.
"""

from __future__ import annotations

import functools
import hashlib
import json
import re
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

# GGUF architecture -> (HF architecture, model_type, q/k rows interleaved by llama.cpp's converter)
_ARCHITECTURES = {
    "llama": ("LlamaForCausalLM", "llama", True),
    "qwen2": ("Qwen2ForCausalLM", "qwen2", False),
    "qwen3": ("Qwen3ForCausalLM", "qwen3", False),
}
_GLOBAL = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
           "output.weight": "lm_head.weight"}
_BLOCK = re.compile(r"blk\.(\d+)\.(.+)")
_LAYER = {
    "attn_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight", "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight", "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias", "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "ffn_gate.weight": "mlp.gate_proj.weight", "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight", "attn_k_norm.weight": "self_attn.k_norm.weight",  # Qwen3
}


def find_gguf(path: str | Path) -> Path | None:
    """The GGUF file `path` names: the file itself, or the one .gguf in a directory without a
    config.json; None when `path` is not a GGUF checkpoint."""
    path = Path(path)
    if path.is_file() and path.suffix == ".gguf":
        return path
    if path.is_dir() and not (path / "config.json").is_file():
        files = sorted(path.glob("*.gguf"))
        if len(files) > 1:
            raise ValueError(f"{path} holds {len(files)} GGUF files ({', '.join(f.name for f in files)}): name one")
        return files[0] if files else None
    return None


def cache_name(gguf_file: Path) -> str:
    stat = gguf_file.stat()
    return _cache_name(str(gguf_file.resolve()), stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=16)
def _cache_name(path: str, size: int, mtime_ns: int) -> str:
    """Hashed once per process and file version: a start resolves the model several times, and a
    multi-GB GGUF takes seconds to hash."""
    gguf_file = Path(path)
    digest = hashlib.sha256()
    with gguf_file.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            digest.update(chunk)
    return f"gguf-{gguf_file.stem}-{digest.hexdigest()[:16]}"


def write_checkpoint(gguf_file: Path, out: Path) -> None:
    """Convert `gguf_file` into directory `out`: config.json, generation_config.json, model.safetensors
    (float32) and the tokenizer files."""
    import gguf

    reader = gguf.GGUFReader(str(gguf_file))
    meta = _metadata(reader)
    arch = meta.get("general.architecture")
    if arch not in _ARCHITECTURES:
        raise ValueError(f"{gguf_file}: GGUF architecture {arch!r} is not supported; tandem converts "
                         f"{sorted(_ARCHITECTURES)}")
    config = _config(meta, arch, {t.name for t in reader.tensors}, gguf_file)
    state = {}
    for tensor in reader.tensors:
        name = _checkpoint_name(tensor.name, gguf_file)
        weights = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        # GGUF lists dimensions fastest first; the de-quantized array is already row-major [rows, cols].
        weights = np.array(weights, dtype=np.float32).reshape(tuple(reversed(tensor.shape.tolist())))  # a copy
        if _ARCHITECTURES[arch][2] and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = config["num_attention_heads"] if "q_proj" in name else config["num_key_value_heads"]
            weights = _halves_from_interleaved(weights, heads)
        state[name] = torch.from_numpy(weights)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2))
    generation = {k: config[k] for k in ("bos_token_id", "eos_token_id") if config.get(k) is not None}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2))
    _write_tokenizer(gguf_file, out)


def _metadata(reader) -> dict:
    out = {}
    for key, field in reader.fields.items():
        if key.startswith("tokenizer.ggml.") and key != "tokenizer.ggml.bos_token_id" and not key.endswith("_id"):
            continue  # the vocabulary itself is the tokenizer's business
        try:
            out[key] = field.contents()
        except (ValueError, TypeError, IndexError):
            continue
    return out


def _config(meta: dict, arch: str, tensors: set[str], gguf_file: Path) -> dict:
    def need(key: str):
        full = f"{arch}.{key}"
        if full not in meta:
            raise ValueError(f"{gguf_file}: GGUF metadata has no {full!r}")
        return meta[full]

    hf_arch, model_type, _ = _ARCHITECTURES[arch]
    heads = int(need("attention.head_count"))
    hidden = int(need("embedding_length"))
    vocab = meta.get(f"{arch}.vocab_size")
    config = {
        "architectures": [hf_arch],
        "model_type": model_type,
        "hidden_size": hidden,
        "intermediate_size": int(need("feed_forward_length")),
        "num_hidden_layers": int(need("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(meta.get(f"{arch}.attention.head_count_kv", heads)),
        "head_dim": int(meta.get(f"{arch}.attention.key_length", hidden // heads)),
        "rms_norm_eps": float(need("attention.layer_norm_rms_epsilon")),
        "rope_theta": float(meta.get(f"{arch}.rope.freq_base", 10000.0)),
        "max_position_embeddings": int(need("context_length")),
        "tie_word_embeddings": "output.weight" not in tensors,
        "attention_bias": "blk.0.attn_q.bias" in tensors,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        "torch_dtype": "float32",
    }
    if vocab is not None:
        config["vocab_size"] = int(vocab)
    if meta.get(f"{arch}.rope.scaling.type") not in (None, "none"):
        raise ValueError(f"{gguf_file}: rope scaling {meta[f'{arch}.rope.scaling.type']!r} in GGUF is not supported")
    return config


def _checkpoint_name(name: str, gguf_file: Path) -> str:
    if name in _GLOBAL:
        return _GLOBAL[name]
    match = _BLOCK.fullmatch(name)
    if match and match.group(2) in _LAYER:
        return f"model.layers.{match.group(1)}.{_LAYER[match.group(2)]}"
    raise ValueError(f"{gguf_file}: GGUF tensor {name!r} has no place in the model")


def _halves_from_interleaved(w: np.ndarray, heads: int) -> np.ndarray:
    """Per head, llama.cpp stores the rotary pairs' rows interleaved (x0, y0, x1, y1, ...); Hugging Face
    stores all x rows, then all y rows."""
    rows, cols = w.shape
    return w.reshape(heads, rows // heads // 2, 2, cols).swapaxes(1, 2).reshape(rows, cols)


def _write_tokenizer(gguf_file: Path, out: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(gguf_file.parent), gguf_file=gguf_file.name)
    tokenizer.save_pretrained(str(out))
