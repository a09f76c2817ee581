"""Small random checkpoints in Hugging Face format, built by `transformers`: one per supported family."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

_CONFIGS = {
    # Llama 3 style: GQA and llama3 rope scaling with a short original context, so the scaling matters.
    "llama": dict(
        architectures=["LlamaForCausalLM"], hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=128, vocab_size=512, max_position_embeddings=512,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 32},
    ),
    # Qwen2: qkv bias, tied embeddings.
    "qwen2": dict(
        architectures=["Qwen2ForCausalLM"], hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=1, intermediate_size=96, vocab_size=400, max_position_embeddings=512,
        tie_word_embeddings=True, rope_theta=1000000.0,
    ),
    # Qwen3: per-head RMSNorm on q and k, head_dim not hidden / heads.
    "qwen3": dict(
        architectures=["Qwen3ForCausalLM"], hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=96, vocab_size=400, max_position_embeddings=512, head_dim=32,
        rope_theta=1000000.0,
    ),
    # Qwen2 with its upper layers windowed (layer_types: full, sliding, full, sliding from max_window_layers):
    # one model mixing sliding-window and full-attention layers.
    "qwen2-mixed": dict(
        architectures=["Qwen2ForCausalLM"], hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=96, vocab_size=400, max_position_embeddings=512,
        use_sliding_window=True, sliding_window=12, max_window_layers=1,
    ),
    # Gemma 2: scaled embeddings, pre+post norms, GeGLU, soft-capped scores and logits, a query scale that
    # is not head_dim, sliding and full layers alternating (layer_types), tied embeddings. Caps this low
    # change this random model's scores and logits (at Gemma's own 50 and 30 they would not).
    "gemma2": dict(
        architectures=["Gemma2ForCausalLM"], hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, intermediate_size=96, vocab_size=400, max_position_embeddings=512,
        sliding_window=12, query_pre_attn_scalar=24, attn_logit_softcapping=0.5, final_logit_softcapping=2.0,
    ),
    # Gemma 3: Gemma 2's layer with (1 + w) q/k norms, no caps; sliding layers (every other one here) turn
    # with a rope of their own base, the full layer with a linearly scaled one.
    "gemma3": dict(
        architectures=["Gemma3ForCausalLM"], hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, intermediate_size=96, vocab_size=400, max_position_embeddings=512,
        sliding_window=12, sliding_window_pattern=2, query_pre_attn_scalar=24,
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1000000.0}},
    ),
    # Phi-3/4: qkv and gate_up fused in the checkpoint, three quarters of each head rotating, longrope with an
    # original context shorter than every prompt, so the long factors and the attention factor apply.
    "phi3": dict(
        architectures=["Phi3ForCausalLM"], hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=96, vocab_size=300, max_position_embeddings=512,
        original_max_position_embeddings=4, partial_rotary_factor=0.75,
        rope_scaling={"rope_type": "longrope", "short_factor": [1.0, 1.2, 1.5, 2.0, 2.5, 3.0],
                      "long_factor": [1.5, 2.0, 3.0, 5.0, 8.0, 12.0]},
    ),
    # Mixtral: every layer routes each token to 2 of 8 experts.
    "mixtral": dict(
        architectures=["MixtralForCausalLM"], hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=48, vocab_size=400, max_position_embeddings=512,
        num_local_experts=8, num_experts_per_tok=2,
    ),
    # Qwen3-MoE: q/k norms, 3 of 8 experts with renormalized weights, the middle layer dense.
    "qwen3-moe": dict(
        architectures=["Qwen3MoeForCausalLM"], hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, intermediate_size=96, moe_intermediate_size=32, vocab_size=400,
        max_position_embeddings=512, num_experts=8, num_experts_per_tok=3, norm_topk_prob=True, mlp_only_layers=[1],
    ),
    # Mistral: a sliding window shorter than the prompts.
    "mistral": dict(
        architectures=["MistralForCausalLM"], hidden_size=64, num_hidden_layers=2, num_attention_heads=8,
        num_key_value_heads=2, intermediate_size=128, vocab_size=300, max_position_embeddings=512,
        sliding_window=24, head_dim=16,
    ),
    # Llama 4 text: rope layers (0, 2) attend in chunks of 8 with L2-normed q/k, NoPE layers (1, 3) see the whole
    # context with queries temperature-tuned (floor_scale 4, so the scale grows within the prompts); layers 1
    # and 3 route each token to 1 of 4 experts beside a shared expert, 0 and 2 are dense (a width of their own);
    # llama3 rope scaling with a short original context.
    "llama4": dict(
        architectures=["Llama4ForCausalLM"], hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, intermediate_size=32, intermediate_size_mlp=96, vocab_size=400,
        max_position_embeddings=512, num_local_experts=4, num_experts_per_tok=1, interleave_moe_layer_step=2,
        attention_chunk_size=8, no_rope_layer_interval=2, floor_scale=4, attn_scale=0.5,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 32},
    ),
    # gpt-oss: sinks, biases everywhere (made random below: transformers starts most at zero), a window of 8
    # on every other layer, YaRN with an original context shorter than the prompts, 2 of 4 experts, and a
    # SwiGLU clamp low enough to cut some of this random model's activations.
    "gpt-oss": dict(
        architectures=["GptOssForCausalLM"], hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, intermediate_size=32, vocab_size=400, max_position_embeddings=512,
        num_local_experts=4, num_experts_per_tok=2, sliding_window=8, swiglu_limit=1.0,
        rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 8.0, "beta_fast": 32.0,
                         "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 64},
    ),
    # DeepSeek-V3: latent attention (q through its own low rank), a dense first layer then 2 of 8 experts
    # in the best 1 of 2 groups plus a shared expert, YaRN with a context 4x the original (and DeepSeek's
    # mscale on the softmax scale); the router's correction bias is random (`_randomize_router_bias`).
    "deepseek-v3": dict(
        architectures=["DeepseekV3ForCausalLM"], hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=4, intermediate_size=96, moe_intermediate_size=32, vocab_size=400,
        max_position_embeddings=512, first_k_dense_replace=1, q_lora_rank=32, kv_lora_rank=16,
        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=8, n_group=2, topk_group=1,
        num_experts_per_tok=2, n_shared_experts=1,
        rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128,
                         "mscale": 1.0, "mscale_all_dim": 0.8, "rope_theta": 10000.0},
    ),
    # DeepSeek-V2-Lite's shape: one q projection, softmax routing over 4 groups (the best 2 kept), 2 shared
    # experts.
    "deepseek-v2": dict(
        architectures=["DeepseekV2ForCausalLM"], hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=96, moe_intermediate_size=32, vocab_size=400, max_position_embeddings=512,
        q_lora_rank=None, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
        n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=2, first_k_dense_replace=1,
        topk_method="group_limited_greedy", n_group=4, topk_group=2, routed_scaling_factor=1.5,
    ),
}
_RANDOM_BIASES = {"gpt-oss"}  # families whose biases and sinks the tests draw at random


def make_hf_model(out_dir: Path, kind: str = "llama", seed: int = 0, with_tokenizer: bool = False, **overrides) -> Path:
    """Save a random `transformers` model of the given family to out_dir; returns the directory."""
    import transformers

    spec = {**_CONFIGS[kind], **overrides}
    arch = spec.pop("architectures")[0]
    config_cls = {"LlamaForCausalLM": transformers.LlamaConfig, "Qwen2ForCausalLM": transformers.Qwen2Config,
                  "MistralForCausalLM": transformers.MistralConfig, "Qwen3ForCausalLM": transformers.Qwen3Config,
                  "Gemma2ForCausalLM": transformers.Gemma2Config, "Gemma3ForCausalLM": transformers.Gemma3TextConfig,
                  "Phi3ForCausalLM": transformers.Phi3Config, "MixtralForCausalLM": transformers.MixtralConfig,
                  "Qwen3MoeForCausalLM": transformers.Qwen3MoeConfig,
                  "Llama4ForCausalLM": transformers.Llama4TextConfig,
                  "GptOssForCausalLM": transformers.GptOssConfig,
                  "DeepseekV2ForCausalLM": transformers.DeepseekV2Config,
                  "DeepseekV3ForCausalLM": transformers.DeepseekV3Config}[arch]
    # A wide init keeps logit gaps large, so float rounding never flips a greedy argmax.
    config = config_cls(initializer_range=0.1, eos_token_id=None, bos_token_id=None, pad_token_id=None, **spec)
    torch.manual_seed(seed)
    model = getattr(transformers, arch)(config).eval()
    if kind in _RANDOM_BIASES:
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith(("bias", "sinks")):
                    param.normal_(0.0, 0.5)
    _randomize_router_bias(model)
    model.save_pretrained(out_dir)
    if with_tokenizer:
        from actors.engine.text.tokenizer import DEFAULT_TOKENIZER_DIR

        for f in DEFAULT_TOKENIZER_DIR.glob("*.json"):
            shutil.copy(f, out_dir / f.name)
    return out_dir


def _randomize_router_bias(model) -> None:
    """DeepSeek-V3's router correction bias starts at zero; random, it changes which experts are chosen."""
    for name, buffer in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            buffer.normal_(0.0, 0.5)


def paged_prefill_logits(model, ids: list[int], block_size: int = 8) -> torch.Tensor:
    """`model`'s logits for every token of `ids`, computed in two chunks (the second reads the first's K/V
    back through the paged cache) over a block table in reverse physical order (the table, not the order
    of the blocks, must decide what is read)."""
    from actors.engine.model.attention import build_attention_batch

    blocks = -(-len(ids) // block_size)
    shape = (blocks + 1, block_size, *model.kv_cache_layout)
    kv = [(torch.zeros(shape), torch.zeros(shape)) for _ in range(model.cfg.num_layers)]
    table = list(range(blocks, 0, -1))
    logits = []
    for start, end in [(0, 30), (30, len(ids))]:
        batch = build_attention_batch([end - start], [start], [table], block_size, model.windows, torch.device("cpu"))
        with torch.inference_mode():
            logits.append(model(torch.tensor(ids[start:end]), batch, kv, torch.arange(end - start)))
    return torch.cat(logits)
