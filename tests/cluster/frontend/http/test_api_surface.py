"""The parts of the OpenAI surface (and vLLM's extras) that clients lean on, with the official `openai`
client against a live 1P+1D cluster: completions logprobs in OpenAI's shape (the sampled token always
among the top ones), the `developer` role, usage in every chunk, /tokenize, /detokenize,
/tokenizer_info, /version, max_model_len in /v1/models, and 4xx answers in the log."""

from __future__ import annotations

import json
import logging

import httpx
import openai
import pytest

from tests.helpers.http_server import MODEL


def test_completion_top_logprobs_include_the_sampled_token(client):
    # Sampled at temperature 1 with a seed: the sampled token is often outside the top 1.
    out = client.completions.create(model=MODEL, prompt="Log probs", max_tokens=12, temperature=1.0, seed=5,
                                    logprobs=1, extra_body={"ignore_eos": True})
    info = out.choices[0].logprobs
    assert all(1 <= len(top) <= 2 for top in info.top_logprobs)
    assert all(top[token] == pytest.approx(lp) for token, lp, top in zip(info.tokens, info.token_logprobs,
                                                                          info.top_logprobs))
    assert any(len(top) == 2 for top in info.top_logprobs), "no sampled token outside the top 1 in 12: pick a seed"
    zero = client.completions.create(model=MODEL, prompt="Log probs", max_tokens=3, temperature=0, logprobs=0,
                                     extra_body={"ignore_eos": True}).choices[0].logprobs
    assert [list(top) for top in zero.top_logprobs] == [[t] for t in zero.tokens]


def test_text_content_parts(client, server):
    """Content as a list of text parts (vLLM's chat benchmark sends it so) is the parts' text joined by a newline,
    as vLLM joins them; other parts are a 400."""
    def ask(content):
        return client.chat.completions.create(model=MODEL, max_tokens=6, temperature=0, extra_body={"ignore_eos": True},
                                              messages=[{"role": "user", "content": content}]).choices[0].message.content
    assert ask([{"type": "text", "text": "Hel"}, {"type": "text", "text": "lo"}]) == ask("Hel\nlo")
    with pytest.raises(openai.BadRequestError) as bad:
        ask([{"type": "image_url", "image_url": {"url": "http://x/y.png"}}])
    assert "only text content parts" in bad.value.body["message"] and bad.value.body["param"] == "messages"


def test_developer_role_is_a_system_message(client):
    def ask(role):
        return client.chat.completions.create(model=MODEL, max_tokens=8, temperature=0, extra_body={"ignore_eos": True},
                                              messages=[{"role": role, "content": "Be brief."},
                                                        {"role": "user", "content": "Hello"}]).choices[0].message.content
    assert ask("developer") == ask("system")


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_continuous_usage_stats(client, chat):
    options = {"include_usage": True, "continuous_usage_stats": True}
    if chat:
        chunks = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                     max_tokens=6, temperature=0, stream=True, stream_options=options,
                                                     extra_body={"ignore_eos": True}))
    else:
        chunks = list(client.completions.create(model=MODEL, prompt="Count", max_tokens=6, temperature=0, stream=True,
                                                stream_options=options, extra_body={"ignore_eos": True}))
    assert all(c.usage is not None for c in chunks)
    counts = [c.usage.completion_tokens for c in chunks]
    assert counts == sorted(counts) and counts[-1] == 6 and counts[0] >= 1
    assert len({c.usage.prompt_tokens for c in chunks}) == 1


def test_tokenize_detokenize_version_and_models(server, engine):
    url = server[1]
    tok = httpx.post(url + "/tokenize", json={"model": MODEL, "prompt": "Hello there"}).json()
    assert tok["tokens"] == engine.tokenizer.encode("Hello there") and tok["count"] == len(tok["tokens"])
    assert tok["max_model_len"] == engine.max_model_len
    messages = [{"role": "user", "content": "Hi"}]
    chat = httpx.post(url + "/tokenize", json={"messages": messages}).json()
    text = engine.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert chat["tokens"] == engine.tokenizer.encode(text, add_special_tokens=False)
    back = httpx.post(url + "/detokenize", json={"model": MODEL, "tokens": tok["tokens"]}).json()
    assert back["prompt"] == engine.tokenizer.decode(tok["tokens"])
    bad = httpx.post(url + "/detokenize", json={"tokens": [1, 10 ** 9]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    both = httpx.post(url + "/tokenize", json={"prompt": "x", "messages": messages})
    assert both.status_code == 400
    assert httpx.post(url + "/tokenize", json={"model": "gpt-17", "prompt": "x"}).status_code == 404
    assert httpx.get(url + "/version").json()["version"]
    info = httpx.get(url + "/tokenizer_info").json()
    assert info["eos_token"] == engine.tokenizer.eos_token and info["model_max_length"] == engine.max_model_len
    (model,) = httpx.get(url + "/v1/models").json()["data"]
    assert model["id"] == MODEL and model["max_model_len"] == engine.max_model_len
    assert httpx.get(url + f"/v1/models/{MODEL}").json() == model
    missing = httpx.get(url + "/v1/models/gpt-17")
    assert missing.status_code == 404 and missing.json()["error"]["param"] == "model", missing.text


def test_client_errors_are_logged(client, caplog):
    with caplog.at_level(logging.INFO, logger="tandem.ingress"):
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="gpt-17", prompt="x")
        with pytest.raises(openai.BadRequestError):
            client.completions.create(model=MODEL, prompt="x", top_p=0)
    lines = [r.getMessage() for r in caplog.records if r.name == "tandem.ingress"]
    assert any("/v1/completions -> 404" in line and "gpt-17" in line for line in lines), lines
    assert any("/v1/completions -> 400" in line and "top_p" in line for line in lines), lines


def test_responses_api(client, engine):
    """OpenAI's Responses API for text, whole and streamed, with instructions and a json_schema format."""
    out = client.responses.create(model=MODEL, input="Hello there", instructions="Be brief.", max_output_tokens=8,
                                  temperature=0)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0)
    assert out.output_text == chat.choices[0].message.content and out.status == "incomplete"
    assert out.usage.output_tokens == 8 and out.usage.input_tokens == chat.usage.prompt_tokens
    events = list(client.responses.create(model=MODEL, input=[{"role": "user", "content": [
        {"type": "input_text", "text": "Hello there"}]}], instructions="Be brief.", max_output_tokens=8,
        temperature=0, stream=True))
    assert events[0].type == "response.created" and events[-1].type == "response.incomplete"  # max_output_tokens
    assert events[-1].response.status == "incomplete" == out.status
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == out.output_text
    assert events[-1].response.output_text == out.output_text
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    structured = client.responses.create(model=MODEL, input="Answer", max_output_tokens=20, temperature=0,
                                         text={"format": {"type": "json_schema", "name": "a", "schema": schema}})
    assert json.loads(structured.output_text)["ok"] in (True, False)
    with pytest.raises(openai.BadRequestError) as bad:
        client.responses.create(model=MODEL, input="x", previous_response_id="resp_1")
    assert bad.value.body["param"] == "previous_response_id"


def test_the_served_openapi_document_is_the_reference_page_s_and_a_bad_body_is_a_400_as_it_says(server):
    """docs/reference/http-api.md is made from `served_document()`, built without a cluster: the live server's
    /openapi.json must be that same document; and a body its model refuses is the 400 the document lists
    (FastAPI's own 422 is never answered, so it is not documented)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[4] / "docs"))
    import gen_reference

    served = httpx.get(server[1] + "/openapi.json", timeout=30).json()
    assert served == gen_reference.served_document()
    assert all("422" not in op["responses"] for ops in served["paths"].values() for op in ops.values())
    answer = httpx.post(server[1] + "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": "many"}, timeout=30)
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "max_tokens", answer.text
    assert "400" in served["paths"]["/v1/completions"]["post"]["responses"]
