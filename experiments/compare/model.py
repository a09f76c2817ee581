"""The compare model: a ~100M-parameter random Llama, so that prefill is expensive on a CPU worker.

Built on first use the way `tandem bench engine` builds its 56M model (transformers' own init from a
fixed seed, no download), into a staging directory renamed into place, so a concurrent builder either
wins or finds it done. It has no tokenizer: the load generator sends token-id prompts, and the ingress
streams token ids when a checkpoint has none.
"""

from __future__ import annotations

from pathlib import Path

from actors.engine.model.default_model import build_random_llama, resolve_model

COMPARE_MODEL = "bench-llama-100m"
COMPARE_LLAMA = dict(  # 12 layers x 6.3M + 2 x 16000 x 768 embeddings: ~100M parameters
    hidden_size=768, num_hidden_layers=12, num_attention_heads=12, num_key_value_heads=4,
    intermediate_size=2048, vocab_size=16000, max_position_embeddings=4096,
)


def ensure_compare_model() -> Path:
    return build_random_llama(COMPARE_MODEL, **COMPARE_LLAMA)


def resolve_compare_model(name: str) -> str:
    """A --model value as a checkpoint path: the compare model by name, the rest as `tandem generate` reads them."""
    return str(ensure_compare_model()) if name == COMPARE_MODEL else resolve_model(name)
