"""GGUF checkpoints: converted into the cache with the `gguf` package, read back by tandem's own loader,
and compared with transformers reading the same file (its GGUF reader is the reference)."""

from __future__ import annotations

import pytest
import torch
import transformers

from actors.engine.config import EngineConfig
from actors.engine.engine import Engine
from actors.engine.model.default_model import resolve_model
from actors.engine.text.tokenizer import load_tokenizer
from actors.protocol.sampling_params import SamplingParams
from tests.helpers.gguf_file import random_llama, random_qwen3, write_gguf


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory):
    return write_gguf(random_llama(tie=True), tmp_path_factory.mktemp("gguf") / "tiny-q8.gguf")


def _reference(path):
    return transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                             dtype=torch.float32).eval()


def test_converted_weights_are_the_ones_transformers_reads(gguf_file, tmp_path, monkeypatch):
    monkeypatch.setenv("TANDEM_CACHE", str(tmp_path))
    model_dir = resolve_model(str(gguf_file))
    assert model_dir.startswith(str(tmp_path / "models" / "gguf-tiny-q8-"))
    assert resolve_model(str(gguf_file.parent)) == model_dir  # a directory holding one GGUF: the same
    ref = _reference(gguf_file).state_dict()
    mine = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).state_dict()
    assert ref.keys() == mine.keys()
    for name in ref:
        assert torch.equal(ref[name], mine[name]), name


def test_greedy_on_a_gguf_equals_transformers_on_the_same_file(gguf_file, tmp_path, monkeypatch):
    monkeypatch.setenv("TANDEM_CACHE", str(tmp_path))
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(10, 2000, (n,), generator=g).tolist() for n in (7, 23, 41)]
    engine = Engine(EngineConfig(model=resolve_model(str(gguf_file)), block_size=8, num_kv_blocks=64))
    results = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
    ref = _reference(gguf_file)
    for prompt, result in zip(prompts, results):
        with torch.no_grad():
            want = ref.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=24, min_new_tokens=24)
        assert result.outputs[0].token_ids == want[0, len(prompt):].tolist()
    engine.check_integrity()


def test_a_qwen3_gguf_equals_transformers_on_the_same_file(tmp_path, monkeypatch):
    """Qwen3 (q/k norms): converted weights and greedy tokens as transformers reads them."""
    monkeypatch.setenv("TANDEM_CACHE", str(tmp_path / "cache"))
    path = write_gguf(random_qwen3(), tmp_path / "qwen3-q8.gguf", arch="qwen3")
    model_dir = resolve_model(str(path))
    ref = _reference(path)
    mine = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    assert type(mine).__name__ == "Qwen3ForCausalLM"
    for name, tensor in ref.state_dict().items():
        assert torch.equal(tensor, mine.state_dict()[name]), name
    prompt = torch.randint(10, 2000, (29,), generator=torch.Generator().manual_seed(5)).tolist()
    engine = Engine(EngineConfig(model=model_dir, block_size=8, num_kv_blocks=32))
    (result,) = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
    with torch.no_grad():
        want = ref.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=24, min_new_tokens=24)
    assert result.outputs[0].token_ids == want[0, len(prompt):].tolist()


def test_tokenizer_and_chat_template_come_from_the_gguf(gguf_file, tmp_path, monkeypatch):
    monkeypatch.setenv("TANDEM_CACHE", str(tmp_path))
    ours = load_tokenizer(resolve_model(str(gguf_file)))
    ref = transformers.AutoTokenizer.from_pretrained(str(gguf_file.parent), gguf_file=gguf_file.name)
    text = "The quick brown fox, 42 times: naïve café!"
    assert ours.encode(text) == ref.encode(text) and ours.decode(ours.encode(text)) == text
    chat = ours.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert chat == "<|start|>user\nhi<|end|>\n<|start|>assistant\n"


def test_unsupported_architecture_and_missing_fields_are_named(tmp_path, monkeypatch):
    monkeypatch.setenv("TANDEM_CACHE", str(tmp_path / "cache"))
    model = random_llama(layers=1)
    with pytest.raises(ValueError, match="GGUF architecture 'gpt2' is not supported"):
        resolve_model(str(write_gguf(model, tmp_path / "gpt2.gguf", arch="gpt2")))
    with pytest.raises(ValueError, match="GGUF metadata has no 'llama.feed_forward_length'"):
        resolve_model(str(write_gguf(model, tmp_path / "nofnn.gguf", skip=("feed_forward_length",))))
    assert not list((tmp_path / "cache" / "models").glob("gguf-*"))  # nothing half-written is left behind
    (tmp_path / "two").mkdir()
    for name in ("a.gguf", "b.gguf"):
        (tmp_path / "two" / name).write_bytes(b"")
    with pytest.raises(ValueError, match="holds 2 GGUF files"):
        resolve_model(str(tmp_path / "two"))
