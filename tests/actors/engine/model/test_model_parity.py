"""Acceptance 1: parity with Hugging Face transformers on the same weights, float32."""

from __future__ import annotations

import pytest
import torch
import transformers

from actors.engine.config import EngineConfig
from actors.engine.engine import Engine
from actors.engine.model.loader import load_model
from actors.protocol.sampling_params import SamplingParams
from tests.helpers.models import make_hf_model, paged_prefill_logits

FAMILIES = ["llama", "qwen2", "qwen3", "mistral", "qwen2-mixed", "gemma2", "gemma3", "phi3", "mixtral", "qwen3-moe",
            "llama4", "gpt-oss", "deepseek-v3", "deepseek-v2"]
BLOCK_SIZE = 8  # does not divide the prompt lengths below


def _hf(model_dir):
    return transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def _prompt(n: int, vocab: int, seed: int) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("family", FAMILIES)
def test_prefill_logits_match_transformers(hf_models, family):
    model_dir = hf_models[family]
    ours = load_model(model_dir)
    ids = _prompt(45, ours.cfg.vocab_size, seed=1)
    with torch.no_grad():
        ref = _hf(model_dir)(torch.tensor([ids])).logits[0]
    got = paged_prefill_logits(ours, ids)
    assert got.shape == ref.shape
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())


def test_longrope_takes_its_short_factors_when_the_context_fits_the_original(tmp_path):
    """Phi-3's longrope factors are picked once, from the deployment's max_model_len: within the original
    context the short ones (as transformers on a sequence that short), beyond it the long ones."""
    model_dir = make_hf_model(tmp_path / "phi3", "phi3", original_max_position_embeddings=64)
    ids = _prompt(45, 300, seed=2)
    with torch.no_grad():
        ref = _hf(model_dir)(torch.tensor([ids])).logits[0]
    short = paged_prefill_logits(load_model(model_dir, context_len=64), ids)
    torch.testing.assert_close(short, ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())
    long = paged_prefill_logits(load_model(model_dir), ids)  # max_position_embeddings 512 > 64
    assert (long - ref).abs().max() > 0.1 * ref.abs().max()


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_continuation_matches_transformers_generate(hf_models, family):
    model_dir = hf_models[family]
    prompts = [_prompt(n, 300, seed=n) for n in (5, 19, 37)]
    engine = Engine(EngineConfig(model=str(model_dir), block_size=BLOCK_SIZE, num_kv_blocks=64))
    results = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
    hf = _hf(model_dir)
    for prompt, result in zip(prompts, results):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=40, min_new_tokens=40)
        assert result.outputs[0].token_ids == ref[0, len(prompt):].tolist()
        assert result.outputs[0].finish_reason == "length"
    engine.check_integrity()
    assert engine.num_used_blocks == 0


def test_sharded_checkpoint_loads_the_same_weights(hf_models, tmp_path):
    hf = _hf(hf_models["llama"])
    hf.save_pretrained(tmp_path, max_shard_size="100KB")
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    whole, sharded = load_model(hf_models["llama"]), load_model(tmp_path)
    for (name, a), (_, b) in zip(whole.state_dict().items(), sharded.state_dict().items()):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("dtype, tolerance", [("bfloat16", 0.1), ("float16", 0.02)])
def test_half_precision_loads_and_stays_close(hf_models, dtype, tolerance):
    model_dir = hf_models["qwen2"]
    full = Engine(EngineConfig(model=str(model_dir), block_size=BLOCK_SIZE, num_kv_blocks=32))
    half = Engine(EngineConfig(model=str(model_dir), block_size=BLOCK_SIZE, num_kv_blocks=32, dtype=dtype))
    assert half.runner.model.embed_tokens.weight.dtype == getattr(torch, dtype)
    assert half.runner.kv_caches[0][0].dtype == getattr(torch, dtype)
    prompt = _prompt(21, 400, seed=3)
    params = SamplingParams(temperature=0.0, max_tokens=1, logprobs=5)
    (a,), (b,) = full.generate([prompt], params), half.generate([prompt], params)
    top_a = dict(a.outputs[0].logprobs[0].top)
    top_b = dict(b.outputs[0].logprobs[0].top)
    shared = set(top_a) & set(top_b)
    assert len(shared) >= 3
    assert max(abs(top_a[t] - top_b[t]) for t in shared) < tolerance


def test_logprobs_match_transformers(hf_models):
    model_dir = hf_models["llama"]
    prompt = _prompt(13, 300, seed=9)
    engine = Engine(EngineConfig(model=str(model_dir), block_size=BLOCK_SIZE, num_kv_blocks=32))
    (result,) = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=3, logprobs=2, ignore_eos=True))
    out = result.outputs[0]
    with torch.no_grad():
        logits = _hf(model_dir)(torch.tensor([prompt + out.token_ids])).logits[0]
    ref = torch.log_softmax(logits, dim=-1)[len(prompt) - 1 : len(prompt) + 2]
    for step, lp in enumerate(out.logprobs):
        assert lp.token_id == out.token_ids[step]
        assert lp.logprob == pytest.approx(ref[step, lp.token_id].item(), abs=1e-4)
        top_ids = torch.topk(ref[step], 2).indices.tolist()
        assert [t for t, _ in lp.top] == top_ids


def test_config_without_architectures_falls_back_to_model_type(hf_models, tmp_path):
    import json
    import shutil

    shutil.copytree(hf_models["qwen3"], tmp_path / "m")
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    del config["architectures"]
    (tmp_path / "m" / "config.json").write_text(json.dumps(config))
    ours, ref = load_model(tmp_path / "m"), load_model(hf_models["qwen3"])
    assert ours.cfg == ref.cfg and ours.cfg.qk_norm


def test_unknown_architecture_and_missing_fields_are_named(hf_models, tmp_path):
    import json
    import shutil

    shutil.copytree(hf_models["llama"], tmp_path / "m")
    path = tmp_path / "m" / "config.json"
    config = json.loads(path.read_text())
    path.write_text(json.dumps({**config, "architectures": ["FalconForCausalLM"]}))
    with pytest.raises(ValueError, match=r"architectures \['FalconForCausalLM'\] not supported"):
        load_model(tmp_path / "m")
    del config["num_attention_heads"], config["hidden_size"]
    path.write_text(json.dumps(config))
    with pytest.raises(ValueError, match="config.json has no 'hidden_size', 'num_attention_heads'"):
        load_model(tmp_path / "m")


def test_experts_saved_stacked_load_the_same_weights(hf_models, tmp_path):
    """Mixtral as transformers 5 holds it in memory (experts stacked, `mlp.gate`) loads like the hub's
    per-expert w1/w2/w3 layout."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    source = hf_models["mixtral"]
    shutil.copytree(source, tmp_path / "m")
    weights = load_file(str(source / "model.safetensors"))
    config = json.loads((source / "config.json").read_text())
    stacked: dict[str, torch.Tensor] = {}
    for i in range(config["num_hidden_layers"]):
        prefix = f"model.layers.{i}.block_sparse_moe"
        experts = range(config["num_local_experts"])
        stacked[f"model.layers.{i}.mlp.experts.gate_up_proj"] = torch.stack(
            [torch.cat([weights.pop(f"{prefix}.experts.{e}.w1.weight"), weights.pop(f"{prefix}.experts.{e}.w3.weight")])
             for e in experts])
        stacked[f"model.layers.{i}.mlp.experts.down_proj"] = torch.stack(
            [weights.pop(f"{prefix}.experts.{e}.w2.weight") for e in experts])
        stacked[f"model.layers.{i}.mlp.gate.weight"] = weights.pop(f"{prefix}.gate.weight")
    save_file({**weights, **stacked}, str(tmp_path / "m" / "model.safetensors"))
    a, b = load_model(source), load_model(tmp_path / "m")
    for (name, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items()):
        assert torch.equal(x, y), name


def test_a_missing_expert_is_reported(hf_models, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(hf_models["qwen3-moe"], tmp_path / "m")
    path = tmp_path / "m" / "model.safetensors"
    weights = load_file(str(path))
    del weights["model.layers.0.mlp.experts.5.up_proj.weight"]
    save_file(weights, str(path))
    with pytest.raises(ValueError, match=r"missing \['layers.0.mlp.down', 'layers.0.mlp.gate_up'\]"):
        load_model(tmp_path / "m")
