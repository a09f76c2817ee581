"""Acceptance 1: parity with Hugging Face transformers on the same weights, float32."""

from __future__ import annotations

import pytest
import torch
import transformers

from actors.engine.config import EngineConfig
from actors.engine.engine import Engine
from actors.engine.model.attention import build_attention_batch
from actors.engine.model.loader import load_model
from actors.protocol.sampling_params import SamplingParams

FAMILIES = ["llama", "qwen2", "qwen3", "mistral", "qwen2-mixed", "gemma2"]
BLOCK_SIZE = 8  # does not divide the prompt lengths below


def _hf(model_dir):
    return transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def _prompt(n: int, vocab: int, seed: int) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("family", FAMILIES)
def test_prefill_logits_match_transformers(hf_models, family):
    model_dir = hf_models[family]
    ours = load_model(model_dir)
    vocab = ours.cfg.vocab_size
    ids = _prompt(45, vocab, seed=1)
    with torch.no_grad():
        ref = _hf(model_dir)(torch.tensor([ids])).logits[0]
    blocks = -(-len(ids) // BLOCK_SIZE)
    shape = (blocks + 1, BLOCK_SIZE, ours.cfg.num_kv_heads, ours.cfg.head_dim)
    kv = [(torch.zeros(shape), torch.zeros(shape)) for _ in range(ours.cfg.num_layers)]
    # Blocks in reverse order: the block table, not physical order, must decide what is read.
    table = list(range(blocks, 0, -1))
    # Two chunks, so the second one reads the first one's K/V back through the paged cache.
    logits = []
    for start, end in [(0, 30), (30, len(ids))]:
        batch = build_attention_batch([end - start], [start], [table], BLOCK_SIZE, ours.windows, torch.device("cpu"))
        with torch.inference_mode():
            logits.append(ours(torch.tensor(ids[start:end]), batch, kv, torch.arange(end - start)))
    got = torch.cat(logits)
    assert got.shape == ref.shape
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())


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
