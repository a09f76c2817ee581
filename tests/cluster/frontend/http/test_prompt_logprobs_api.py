"""Prompt scoring through the HTTP API of a live 1P+1D cluster, as lm-eval's loglikelihood tasks use it
(`echo` + `logprobs` + `max_tokens` 1, and `max_tokens` 0), and vLLM's `prompt_logprobs` extra: every
prompt token's logprob equals transformers' (the first is null), with or without a prefix-cache hit."""

from __future__ import annotations

import httpx
import pytest
import torch

from tests.helpers.http_server import MODEL


@pytest.fixture(scope="module")
def reference(engine):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(engine.config.model, torch_dtype=torch.float32).eval()

    def logprobs(ids: list[int]) -> list[float]:
        with torch.no_grad():
            lp = model(torch.tensor([ids])).logits[0].float().log_softmax(-1)
        return [lp[i - 1, ids[i]].item() for i in range(1, len(ids))]
    return logprobs


CONTEXT = "The capital of France is a city that many people visit every year, and its name is"


@pytest.mark.parametrize("warm", [False, True], ids=["cold", "prefix-cached"])
def test_echo_logprobs_score_the_prompt_like_transformers(client, engine, reference, warm):
    prompt = engine.tokenizer.encode(CONTEXT + (" Paris" if warm else " Lyon"))
    if warm:  # the prompt's blocks are in the prefill worker's cache: scoring must not lose them
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0)
    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0, echo=True, logprobs=1)
    info = out.choices[0].logprobs
    assert len(info.token_logprobs) == len(prompt) + 1  # every prompt token, then the generated one
    assert info.token_logprobs[0] is None and info.top_logprobs[0] is None
    assert info.token_logprobs[1:-1] == pytest.approx(reference(prompt), abs=1e-3)
    assert all(top[tok] == pytest.approx(lp) for tok, lp, top in zip(info.tokens[1:], info.token_logprobs[1:],
                                                                     info.top_logprobs[1:]))
    assert out.choices[0].text.startswith(engine.tokenizer.decode(prompt, skip_special_tokens=True))


def test_max_tokens_0_scores_only(client, engine, reference, server):
    prompt = engine.tokenizer.encode(CONTEXT)
    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=0, echo=True, logprobs=0)
    choice = out.choices[0]
    assert choice.text == engine.tokenizer.decode(prompt, skip_special_tokens=True)
    assert len(choice.logprobs.token_logprobs) == len(prompt)
    assert choice.logprobs.token_logprobs[1:] == pytest.approx(reference(prompt), abs=1e-3)
    assert out.usage.completion_tokens == 0 and choice.finish_reason == "length"
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=0, echo=True, logprobs=0,
                                            stream=True))
    assert "".join(c.choices[0].text for c in chunks) == choice.text
    assert chunks[0].choices[0].logprobs.token_logprobs[1:] == pytest.approx(reference(prompt), abs=1e-3)
    bare = httpx.post(server[1] + "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 0})
    assert bare.status_code == 400 and bare.json()["error"]["param"] == "max_tokens"  # without echo: nothing to do


def test_vllm_prompt_logprobs_extra(server, engine, reference):
    prompt = engine.tokenizer.encode(CONTEXT)
    body = httpx.post(server[1] + "/v1/completions", timeout=60, json={
        "model": MODEL, "prompt": prompt, "max_tokens": 2, "temperature": 0, "prompt_logprobs": 2}).json()
    scores = body["choices"][0]["prompt_logprobs"]
    assert scores[0] is None and len(scores) == len(prompt)
    for i, (entry, want) in enumerate(zip(scores[1:], reference(prompt)), start=1):
        own = entry[str(prompt[i])]
        assert own["logprob"] == pytest.approx(want, abs=1e-3) and own["rank"] >= 1
        assert 2 <= len(entry) <= 3 and own["decoded_token"] == engine.tokenizer.decode([prompt[i]])
    chat = httpx.post(server[1] + "/v1/chat/completions", timeout=60, json={
        "model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "prompt_logprobs": 0}).json()
    assert chat["choices"][0]["prompt_logprobs"][0] is None and len(chat["choices"][0]["prompt_logprobs"]) > 3
