"""gpt-oss beyond the shared parity tests: greedy decoding on each CPU attention path (the C kernel's
sinks and the reference SDPA path's) and the checkpoint's interleaved experts. Tensor parallelism:
test_tensor_parallel.py."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import transformers
from safetensors import safe_open

from actors.engine.config import EngineConfig
from actors.engine.engine import Engine
from actors.engine.model.loader import load_model
from actors.protocol.sampling_params import SamplingParams


@pytest.mark.parametrize("backend", ["sdpa", "cpu"])
def test_greedy_matches_transformers_on_each_cpu_attention_path(hf_models, backend):
    """Prompts shorter than, about, and many times the window of 8; 30 tokens decoded past them."""
    model_dir = hf_models["gpt-oss"]
    prompts = [torch.randint(0, 400, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (3, 9, 41)]
    engine = Engine(EngineConfig(model=str(model_dir), block_size=8, num_kv_blocks=64, attention_backend=backend))
    assert engine.runner.attention.name == backend
    results = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    for prompt, result in zip(prompts, results):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=30, min_new_tokens=30)
        assert result.outputs[0].token_ids == ref[0, len(prompt):].tolist()
    engine.check_integrity()


def test_interleaved_experts_load_as_gate_rows_then_up_rows(hf_models):
    model_dir = hf_models["gpt-oss"]
    ours = load_model(model_dir)
    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as f:
        gate_up = f.get_tensor("model.layers.1.mlp.experts.gate_up_proj")  # [E, H, 2I], gate at even columns
        bias = f.get_tensor("model.layers.1.mlp.experts.gate_up_proj_bias")
        down = f.get_tensor("model.layers.1.mlp.experts.down_proj")  # [E, I, H]
    mlp = ours.layers[1].mlp
    width = gate_up.shape[-1] // 2
    assert torch.equal(mlp.gate_up[2, :width], gate_up[2, :, 0::2].T)
    assert torch.equal(mlp.gate_up[2, width:], gate_up[2, :, 1::2].T)
    assert torch.equal(mlp.gate_up_bias[3], torch.cat([bias[3, 0::2], bias[3, 1::2]]))
    assert torch.equal(mlp.down[1], down[1].T)



def test_cuda_kernels_without_sinks_refuse_sink_layers_by_name(hf_models):
    """FlashInfer and tandem's Triton kernel take no sinks: such layers attend with SDPA (auto), and an
    explicit choice of either is an error that says why."""
    from actors.engine.model.backend_choice import choose_attention_backend
    from actors.engine.model.flashinfer_backend import refusal

    layers = load_model(hf_models["gpt-oss"]).layer_attentions()
    assert all(layer.sinks is not None and len(layer.sinks) == 4 for layer in layers)
    served_shape = dataclasses.replace(layers[0], head_dim=64)  # FlashInfer would serve it but for the sinks
    assert "attention sinks" in refusal(served_shape, torch.bfloat16)
    assert refusal(dataclasses.replace(served_shape, sinks=None), torch.bfloat16) is None
    with pytest.raises(ValueError, match="its kernel has no attention sinks"):
        choose_attention_backend("triton", layers, (8, None), 8, torch.float32, torch.device("cpu"))


@pytest.mark.parametrize("softcap, sinks", [(None, (0.5, -1.0, 2.0, 0.0)), (3.0, None), (3.0, (1.0, 1.0, -2.0, 4.0))])
def test_materialized_scores_in_row_passes_equal_one_pass(monkeypatch, softcap, sinks):
    """The SDPA path's materialized scores (sinks, caps) go a few query rows at a time; any split of the
    rows gives the same output, windowed or causal, for a fresh prompt and a chunk after a cached context."""
    from actors.engine.model import attention

    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, heads, n, 16, generator=gen) for heads, n in ((4, 37), (2, 53), (2, 53)))
    for mask in (None, attention._prefill_mask(37, 53, 8, "cpu")):
        queries = q if mask is not None else q[:, :, :37]
        keys, values = (k, v) if mask is not None else (k[:, :, :37], v[:, :, :37])
        whole = attention._attend(queries, keys, values, mask, 0.25, softcap, sinks)
        monkeypatch.setattr(attention, "SCORES_PER_PASS", 4 * 53 * 5)  # 5 query rows a pass
        parts = attention._attend(queries, keys, values, mask, 0.25, softcap, sinks)
        monkeypatch.undo()
        torch.testing.assert_close(parts, whole, rtol=1e-6, atol=1e-6)


def test_the_published_120b_config_reads_with_transformers_defaults_and_mxfp4_is_refused():
    """gpt-oss-120b's config.json as published (old `rope_scaling` beside `rope_theta`); without
    `layer_types` the layers alternate sliding and full from the first, as transformers' default."""
    from actors.engine.model.gpt_oss import GptOssConfig

    hf = {"architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "num_hidden_layers": 36,
          "hidden_size": 2880, "intermediate_size": 2880, "num_attention_heads": 64, "num_key_value_heads": 8,
          "head_dim": 64, "vocab_size": 201088, "num_local_experts": 128, "num_experts_per_tok": 4,
          "sliding_window": 128, "rope_theta": 150000, "max_position_embeddings": 131072,
          "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                           "truncate": False, "original_max_position_embeddings": 4096}}
    cfg = GptOssConfig.from_hf(hf)
    assert cfg.sliding_windows == (128, None) * 18
    assert (cfg.rope_theta, cfg.rope_scaling["rope_type"], cfg.rope_scaling["factor"]) == (150000.0, "yarn", 32.0)
    assert (cfg.num_experts, cfg.experts_per_token, cfg.expert_intermediate_size) == (128, 4, 2880)
    assert cfg.attention_bias and cfg.rms_norm_eps == 1e-5 and cfg.swiglu_limit == 7.0
    with pytest.raises(ValueError, match="mxfp4 weights are not supported"):
        GptOssConfig.from_hf({**hf, "quantization_config": {"quant_method": "mxfp4"}})


@pytest.mark.parametrize("rope", [
    {"factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 4096},
    {"factor": 40.0, "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0,
     "original_max_position_embeddings": 4096},  # DeepSeek-V3's, truncated (the default)
    {"factor": 4.0, "original_max_position_embeddings": 2048, "attention_factor": 1.3},
])
def test_yarn_frequencies_and_attention_factor_match_transformers(rope):
    from transformers import GptOssConfig as HFConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from actors.engine.model.rope import RopeSpec, inverse_frequencies, read_rope_parameters

    parameters = {"rope_type": "yarn", "rope_theta": 150000.0, **rope}
    hf_config = HFConfig(head_dim=64, max_position_embeddings=131072, rope_parameters=parameters)
    ref_freq, ref_factor = ROPE_INIT_FUNCTIONS["yarn"](hf_config)
    theta, scaling = read_rope_parameters({"rope_parameters": parameters})
    freq, factor = inverse_frequencies(RopeSpec(theta, scaling, 64, 131072), 131072)
    torch.testing.assert_close(freq, ref_freq, rtol=1e-6, atol=0)
    assert factor == pytest.approx(ref_factor, rel=1e-7)
