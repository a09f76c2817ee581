"""DeepSeek-V2/V3 (deepseek.py, mla_attention.py): both ways of attending over the latent cache match
transformers, the cache keeps one latent row per token, and the parts a random config could leave idle
(the router's correction bias, a rotate-half checkpoint) are checked to matter. Prefill and greedy
parity through the Engine are in test_model_parity's FAMILIES."""

from __future__ import annotations

import pytest
import torch
import transformers

from actors.engine.config import EngineConfig
from actors.engine.engine import Engine
from actors.engine.model import mla_attention
from actors.engine.model.loader import load_model
from actors.protocol.sampling_params import SamplingParams
from tests.helpers.models import make_hf_model, paged_prefill_logits


def _reference(model_dir, ids: list[int]) -> torch.Tensor:
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0]


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, 400, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _close(got: torch.Tensor, ref: torch.Tensor) -> None:
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())


@pytest.mark.parametrize("family", ["deepseek-v3", "deepseek-v2"])
@pytest.mark.parametrize("absorbed", [False, True])
def test_plain_and_absorbed_attention_both_match_transformers(hf_models, monkeypatch, family, absorbed):
    """Every run of queries attends one way (by default the cheaper one: chunks this short would all be
    absorbed), over a paged context read back through a reversed block table."""
    monkeypatch.setattr(mla_attention, "absorbs", lambda *_: absorbed)
    ids = _prompt(45, seed=4)
    _close(paged_prefill_logits(load_model(hf_models[family]), ids), _reference(hf_models[family], ids))


def test_the_crossover_picks_absorbed_for_short_runs_only():
    w = mla_attention.LatentWeights(torch.empty(128 * (128 + 128), 512), 128, 128, 128)  # DeepSeek-V3's widths
    assert [mla_attention.absorbs(q, w, 512 + 64) for q in (1, 227, 228, 4096)] == [True, True, False, False]


def test_rotate_half_checkpoint_matches_transformers(tmp_path):
    """A V3 checkpoint without rope_interleave: its q and kv_a rotary rows are permuted at load."""
    model_dir = make_hf_model(tmp_path / "m", "deepseek-v3", seed=3, rope_interleave=False)
    ids = _prompt(45, seed=5)
    ref = _reference(model_dir, ids)
    _close(paged_prefill_logits(load_model(model_dir), ids), ref)
    interleaved = make_hf_model(tmp_path / "i", "deepseek-v3", seed=3)  # same weights, the other layout
    assert (paged_prefill_logits(load_model(interleaved), ids) - ref).abs().max() > 1e-3 * ref.abs().max()


def test_router_correction_bias_changes_the_chosen_experts(hf_models):
    """The test config's bias is random (make_hf_model): zeroing it must change the logits, so parity
    above covers the biased choice."""
    model = load_model(hf_models["deepseek-v3"])
    ids = _prompt(45, seed=6)
    with_bias = paged_prefill_logits(model, ids)
    for layer in model.layers[1:]:
        layer.mlp.correction_bias.data.zero_()
    assert (paged_prefill_logits(model, ids) - with_bias).abs().max() > 1e-3 * with_bias.abs().max()


def test_kv_pool_stores_one_latent_row_per_token(hf_models, capsys):
    model_dir = hf_models["deepseek-v3"]
    engine = Engine(EngineConfig(model=str(model_dir), block_size=8, num_kv_blocks=16))
    cfg = engine.runner.cfg
    latent = cfg.kv_lora_rank + cfg.qk_rope_head_dim
    mla_bytes = cfg.num_layers * latent * 4
    mha_bytes = cfg.num_layers * cfg.num_heads * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim + cfg.v_head_dim) * 4
    pool_bytes = sum(t.numel() * t.element_size() for pair in engine.runner.kv_caches for t in pair)
    with capsys.disabled():
        print(f"\nKV bytes per token: pool {pool_bytes // (16 * 8)}, MLA formula layers x (kv_lora_rank + rope) x 4 = "
              f"{mla_bytes}; per-head K and V would be {mha_bytes}")
    assert engine.runner.kv_caches[0][0].shape == (16, 8, 1, latent // 2)
    assert engine.bytes_per_block == 8 * mla_bytes == pool_bytes // 16
    # The pool is used: a generation fills and frees blocks as for any model.
    (result,) = engine.generate([_prompt(20, seed=7)], SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True))
    assert len(result.outputs[0].token_ids) == 5
    engine.check_integrity()
    assert engine.num_used_blocks == 0


def test_an_fp8_release_is_refused_by_name(hf_models, tmp_path):
    import json
    import shutil

    shutil.copytree(hf_models["deepseek-v3"], tmp_path / "m")
    path = tmp_path / "m" / "config.json"
    config = json.loads(path.read_text())
    config["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    path.write_text(json.dumps(config))
    with pytest.raises(ValueError, match="fp8-quantized checkpoint"):
        load_model(tmp_path / "m")


def test_other_attention_backends_are_refused_by_name(hf_models):
    with pytest.raises(ValueError, match="latent attention .* runs on 'sdpa'"):
        Engine(EngineConfig(model=str(hf_models["deepseek-v3"]), block_size=8, num_kv_blocks=16,
                            attention_backend="cpu"))


def test_bfloat16_stays_close_to_float32(hf_models):
    """Weights, latents and the cache in bfloat16 (the router's softmax/sigmoid and the attention softmax
    in float32): the prompt's step and two absorbed decode steps keep float32's tokens, and their top
    logprobs stay within 0.1 of float32's."""
    model_dir = str(hf_models["deepseek-v3"])
    full = Engine(EngineConfig(model=model_dir, block_size=8, num_kv_blocks=32))
    half = Engine(EngineConfig(model=model_dir, block_size=8, num_kv_blocks=32, dtype="bfloat16"))
    assert half.runner.kv_caches[0][0].dtype == torch.bfloat16
    params = SamplingParams(temperature=0.0, max_tokens=3, logprobs=5, ignore_eos=True)
    prompt = _prompt(21, seed=8)
    (a,), (b,) = full.generate([prompt], params), half.generate([prompt], params)
    assert a.outputs[0].token_ids == b.outputs[0].token_ids  # so each step's logprobs share a context
    for step_a, step_b in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
        top_a, top_b = dict(step_a.top), dict(step_b.top)
        shared = set(top_a) & set(top_b)
        assert len(shared) >= 3
        assert max(abs(top_a[t] - top_b[t]) for t in shared) < 0.1
