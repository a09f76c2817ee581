"""Llama 4 text beyond the parity tests of every family (test_model_parity.py): its decodes on the
reference SDPA path (chunked decode masks built per step), the text model of a multimodal checkpoint
(as the hub ships Llama 4), and the configs tandem refuses."""

from __future__ import annotations

import json

import pytest
import torch
import transformers

from actors.engine.config import EngineConfig
from actors.engine.engine import Engine
from actors.engine.model.llama4 import Llama4Config, Llama4Model
from actors.engine.model.loader import load_model
from tests.helpers.models import paged_prefill_logits
from actors.protocol.sampling_params import SamplingParams


def test_sdpa_decodes_keep_to_the_chunks_as_transformers_does(hf_models):
    model_dir = hf_models["llama4"]
    # 7 and twice 29 tokens (the two prefill side by side in one call, chunk by chunk); decodes cross edges of 8.
    prompts = [list(range(3, 10)), list(range(40, 69)), list(range(100, 129))]
    engine = Engine(EngineConfig(model=str(model_dir), block_size=8, num_kv_blocks=32, attention_backend="sdpa"))
    assert engine.runner.attention.name == "sdpa"
    results = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        refs = [hf.generate(torch.tensor([p]), do_sample=False, max_new_tokens=20, min_new_tokens=20)[0, len(p):]
                for p in prompts]
    assert [r.outputs[0].token_ids for r in results] == [ref.tolist() for ref in refs]
    engine.check_integrity()


def test_the_text_model_of_a_multimodal_checkpoint_is_served(hf_models, tmp_path):
    """A Llama4ForConditionalGeneration directory (text_config inside, weights under language_model., a
    vision encoder beside): tandem loads the text model alone, with the logits transformers gives text."""
    text = transformers.Llama4TextConfig.from_pretrained(hf_models["llama4"])
    vision = transformers.Llama4VisionConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                             intermediate_size=64, image_size=32, patch_size=16, vision_output_dim=32,
                                             projector_input_dim=32, projector_output_dim=32)
    torch.manual_seed(0)
    hf = transformers.Llama4ForConditionalGeneration(transformers.Llama4Config(text_config=text, vision_config=vision))
    hf.eval().save_pretrained(tmp_path)
    ids = torch.randint(0, 400, (45,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.no_grad():
        ref = hf(input_ids=torch.tensor([ids])).logits[0]
    got = paged_prefill_logits(load_model(tmp_path), ids)
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())


def test_the_layer_kinds_come_from_the_config(hf_models):
    cfg = Llama4Config.from_hf(json.loads((hf_models["llama4"] / "config.json").read_text()))
    assert cfg.rope_layers == (True, False, True, False) and cfg.attention_chunks == (8, None, 8, None)
    assert cfg.dense_layers == (0, 2) and (cfg.intermediate_size, cfg.expert_intermediate_size) == (96, 32)
    model = Llama4Model(cfg)
    assert [layer.attn.layer_attention.chunk for layer in model.layers] == [8, None, 8, None]
    assert len(model.layer_attentions()) == 2


def test_what_tandem_refuses_is_named(hf_models):
    hf = json.loads((hf_models["llama4"] / "config.json").read_text())
    with pytest.raises(ValueError, match="attention_bias"):
        Llama4Config.from_hf({**hf, "attention_bias": True})
    with pytest.raises(ValueError, match="chunked_attention layers need attention_chunk_size"):
        Llama4Config.from_hf({**hf, "attention_chunk_size": None})
