"""Small random Llama checkpoints written as GGUF files, the way llama.cpp's converter lays them out
(q and k rows interleaved per head, dimensions fastest first), with tandem's embedded byte-level BPE
tokenizer as a `gpt2` vocabulary in the metadata. transformers reads them as the reference."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from actors.engine.text.tokenizer import DEFAULT_TOKENIZER_DIR

CHAT_TEMPLATE = ("{% for m in messages %}<|start|>{{ m['role'] }}\n{{ m['content'] }}<|end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|start|>assistant\n{% endif %}")
_NAMES = {
    "input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight",
}


def random_llama(hidden: int = 128, layers: int = 2, heads: int = 4, kv_heads: int = 2, inter: int = 256,
                 tie: bool = False, seed: int = 0):
    import transformers

    torch.manual_seed(seed)
    config = transformers.LlamaConfig(vocab_size=2048, hidden_size=hidden, intermediate_size=inter,
                                      num_hidden_layers=layers, num_attention_heads=heads,
                                      num_key_value_heads=kv_heads, max_position_embeddings=1024,
                                      rms_norm_eps=1e-5, tie_word_embeddings=tie, initializer_range=0.05,
                                      bos_token_id=0, eos_token_id=1)
    return transformers.LlamaForCausalLM(config).eval()


def random_qwen3(seed: int = 0):
    """Qwen3: per-head q/k norms, rotary halves (not interleaved as llama.cpp lays out `llama`), head_dim 128
    with hidden 128 (transformers' GGUF reader, the reference, takes Qwen3's default head_dim, 128)."""
    import transformers

    torch.manual_seed(seed)
    config = transformers.Qwen3Config(vocab_size=2048, hidden_size=128, intermediate_size=192, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=128,
                                      max_position_embeddings=1024, rms_norm_eps=1e-6, tie_word_embeddings=True,
                                      initializer_range=0.05, bos_token_id=0, eos_token_id=1)
    return transformers.Qwen3ForCausalLM(config).eval()


def write_gguf(model, path: Path, qtype: str = "Q8_0", arch: str = "llama", skip: tuple[str, ...] = ()) -> Path:
    """`model` (a transformers Llama or Qwen3) as a GGUF file; matrices quantized to `qtype`, norms in F32.
    `skip`: metadata keys (without the architecture prefix) to leave out, to test the errors."""
    import gguf

    c = model.config
    w = gguf.GGUFWriter(str(path), arch)
    meta = {"block_count": c.num_hidden_layers, "context_length": c.max_position_embeddings,
            "embedding_length": c.hidden_size, "feed_forward_length": c.intermediate_size,
            "attention.head_count": c.num_attention_heads, "attention.head_count_kv": c.num_key_value_heads}
    for key, value in meta.items():
        if key not in skip:
            w.add_uint32(f"{arch}.{key}", value)
    if getattr(c, "head_dim", None):
        w.add_uint32(f"{arch}.attention.key_length", c.head_dim)
        w.add_uint32(f"{arch}.attention.value_length", c.head_dim)
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", c.rms_norm_eps)
    w.add_float32(f"{arch}.rope.freq_base", 10000.0)
    w.add_uint32(f"{arch}.vocab_size", c.vocab_size)
    _add_tokenizer(w)
    quant = getattr(gguf.GGMLQuantizationType, qtype)
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        array = tensor.detach().float().numpy()
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):  # llama.cpp's rotary layout
            heads = c.num_attention_heads if "q_proj" in name else c.num_key_value_heads
            rows, cols = array.shape
            array = array.reshape(heads, 2, rows // heads // 2, cols).swapaxes(1, 2).reshape(rows, cols)
        gguf_name = _gguf_name(name)
        if array.ndim == 2:
            w.add_tensor(gguf_name, gguf.quants.quantize(array, quant), raw_dtype=quant)
        else:
            w.add_tensor(gguf_name, np.ascontiguousarray(array, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _gguf_name(name: str) -> str:
    fixed = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    if name in fixed:
        return fixed[name]
    _, _, layer, rest = name.split(".", 3)
    return f"blk.{layer}.{_NAMES[rest]}"


def _add_tokenizer(w) -> None:
    tok = json.loads((DEFAULT_TOKENIZER_DIR / "tokenizer.json").read_text())
    vocab = dict(tok["model"]["vocab"])
    for added in tok["added_tokens"]:
        vocab[added["content"]] = added["id"]
    tokens = [None] * (max(vocab.values()) + 1)
    for text, i in vocab.items():
        tokens[i] = text
    special = {t["id"] for t in tok["added_tokens"]}
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([3 if i in special else 1 for i in range(len(tokens))])
    w.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in tok["model"]["merges"]])
    w.add_bos_token_id(0)
    w.add_eos_token_id(1)
    w.add_add_bos_token(False)
    w.add_chat_template(CHAT_TEMPLATE)
