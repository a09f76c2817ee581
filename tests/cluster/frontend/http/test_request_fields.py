"""No request field is accepted without an effect. Every field of the chat and completions request models
(read from the pydantic models: a field added later without a decision here fails) is sent to the live
1P+1D server with a value that asks for something, and its effect is seen; every field of OpenAI's and
vLLM's schemas the server does not honour (`fields.REFUSED`) is a 400 naming it, and an unknown field is a
400 naming it unless `ingress.unknown_fields: accept` (then it is logged)."""

from __future__ import annotations

import json
import logging

import httpx
import openai
import pytest

from cluster.control.config import IngressSection
from cluster.frontend.http.chat_template import TemplateOptions, render, template_variables
from cluster.frontend.http.fields import REFUSED
from cluster.frontend.http.protocol import ApiError, ChatCompletionRequest, CompletionRequest
from cluster.frontend.http.server import make_server
from tests.helpers.field_probe import FieldProbe
from tests.helpers.http_server import MODEL, running

PROMPT = "The quick brown fox"
ASK = [{"role": "user", "content": "Hello there"}]
SCHEMA = {"type": "object", "properties": {"a": {"enum": [1]}}, "required": ["a"], "additionalProperties": False}
EOS, BOS = 1, 0  # the tiny model's tokenizer


class Api(FieldProbe):
    """One endpoint through the official client, greedy with `ignore_eos` unless a call says otherwise."""

    def __init__(self, client: openai.OpenAI, tokenizer, chat: bool):
        self.client, self.tok, self.is_chat = client, tokenizer, chat

    def call(self, **body):
        fields = {"max_tokens": 8, "temperature": 0, "ignore_eos": True, **body}
        sdk = {k: fields.pop(k) for k in ("model", "stream", "stream_options") if k in fields}  # the client reads these
        sdk.setdefault("model", MODEL)
        if self.is_chat:
            return self.client.chat.completions.create(messages=fields.pop("messages", ASK), extra_body=fields, **sdk)
        return self.client.completions.create(prompt=fields.pop("prompt", PROMPT), extra_body=fields, **sdk)

    def text(self, **body) -> str:
        choice = self.call(**body).choices[0]
        return choice.message.content if self.is_chat else choice.text

    def sampled(self, **body) -> str:
        return self.text(**{"temperature": 1.0, "seed": 3, "max_tokens": 16, **body})

    def prompt_ids(self, add_special_tokens: bool | None = None, **options) -> list[int]:
        """The default prompt's ids, as the endpoint makes them (chat: through the chat template)."""
        if not self.is_chat:
            return self.tok.encode(PROMPT, add_special_tokens=add_special_tokens is not False)
        text = self.tok.apply_chat_template(options.pop("messages", ASK), tokenize=False,
                                            **{"add_generation_prompt": True, **options})
        return self.tok.encode(text, add_special_tokens=bool(add_special_tokens))


@pytest.fixture(scope="module")
def apis(server, engine) -> dict[str, Api]:
    client = openai.OpenAI(base_url=server[1] + "/v1", api_key="unused", max_retries=0)
    return {"completions": Api(client, engine.tokenizer, False), "chat": Api(client, engine.tokenizer, True)}


def _middle(text: str) -> str:
    return text[len(text) // 2:len(text) // 2 + 3]


def _stop(api, include: bool) -> bool:
    greedy = api.text(max_tokens=12)
    word = _middle(greedy)
    out = api.call(max_tokens=12, stop=[word], include_stop_str_in_output=include).choices[0]
    text = out.message.content if api.is_chat else out.text
    return out.finish_reason == "stop" and text == greedy[:greedy.index(word)] + (word if include else "")


def _streamed(api) -> bool:
    chunks = list(api.call(stream=True))
    deltas = [(c.choices[0].delta.content or "") if api.is_chat else c.choices[0].text for c in chunks if c.choices]
    return len(deltas) >= 8 and "".join(deltas) == api.text()


def _truncated(api) -> bool:
    ids = api.prompt_ids()
    out = api.call(truncate_prompt_tokens=3)
    again = api.client.completions.create(model=MODEL, prompt=ids[-3:], max_tokens=8, temperature=0,
                                          extra_body={"ignore_eos": True})
    text = out.choices[0].message.content if api.is_chat else out.choices[0].text
    return out.usage.prompt_tokens == 3 and text == again.choices[0].text


def _token_ids(api) -> bool:
    """Logprobs name every token, the sampled one and its alternatives, `token_id:N` (streamed too): the
    ids of the tokens the plain answer names by their text, with the same logprobs and text offsets."""
    def named(token: str) -> str:
        assert token.startswith("token_id:"), token
        return api.tok.decode([int(token.removeprefix("token_id:"))])

    body = {"allowed_token_ids": [300]}
    if api.is_chat:
        def seen(content) -> list:
            return [(t.token, t.logprob, [(a.token, a.logprob) for a in t.top_logprobs]) for t in content]

        plain = seen(api.call(logprobs=True, top_logprobs=2, **body).choices[0].logprobs.content)
        by_id = api.call(logprobs=True, top_logprobs=2, return_tokens_as_token_ids=True, **body).choices[0].logprobs
        streamed = [t.token for c in api.call(stream=True, logprobs=True, return_tokens_as_token_ids=True, **body)
                    if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
        return {(t.token, bytes(t.bytes)) for t in by_id.content} == {("token_id:300", b"token_id:300")} and \
            [(named(t), lp, [(named(a), alp) for a, alp in top]) for t, lp, top in seen(by_id.content)] == plain \
            and streamed == ["token_id:300"] * 8
    plain = api.call(logprobs=2, **body).choices[0].logprobs
    by_id = api.call(logprobs=2, return_tokens_as_token_ids=True, **body).choices[0].logprobs
    streamed = [t for c in api.call(stream=True, logprobs=2, return_tokens_as_token_ids=True, **body)
                for t in c.choices[0].logprobs.tokens]
    return by_id.tokens == streamed == ["token_id:300"] * 8 and by_id.text_offset == plain.text_offset and \
        [{named(t): lp for t, lp in top.items()} for top in by_id.top_logprobs] == plain.top_logprobs


def _stored(api) -> bool:
    """A chat completion with `store: true` is read back by id, a streamed one as its whole answer; one
    without is not kept."""
    kept, not_kept = api.call(store=True), api.call()
    with pytest.raises(openai.NotFoundError):
        api.client.chat.completions.retrieve(not_kept.id)
    chunks = list(api.call(store=True, stream=True))
    streamed = api.client.chat.completions.retrieve(chunks[0].id)
    return api.client.chat.completions.retrieve(kept.id).choices[0].message.content == kept.choices[0].message.content \
        == streamed.choices[0].message.content == "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


def _max_tokens(api, name: str) -> bool:
    return api.call(**{name: 5}).usage.completion_tokens == 5 and api.refused(name, **{name: 2048})


# field -> a check that its value was honoured (True) or refused by name (`api.refused`, True).
COMMON = {
    "model": lambda api, _: api.fails(openai.NotFoundError, model="gpt-17"),
    "n": lambda api, _: len(api.call(n=2).choices) == 2,
    "stream": lambda api, _: _streamed(api),
    "stream_options": lambda api, _: list(api.call(stream=True, stream_options={"include_usage": True}))[-1]
    .usage.completion_tokens == 8,
    "temperature": lambda api, _: api.sampled() != api.text(max_tokens=16),
    "top_p": lambda api, _: api.sampled(top_p=1e-9) == api.text(max_tokens=16),
    "top_k": lambda api, _: api.sampled(top_k=1) == api.text(max_tokens=16),
    "min_p": lambda api, _: api.sampled(min_p=1.0) == api.text(max_tokens=16),
    "typical_p": lambda api, _: api.sampled(typical_p=0.05) != api.sampled(),
    "seed": lambda api, _: api.sampled() == api.sampled() != api.sampled(seed=4),
    "stop": lambda api, _: _stop(api, include=False),
    "include_stop_str_in_output": lambda api, _: _stop(api, include=True),
    "stop_token_ids": lambda api, _: api.call(allowed_token_ids=[300], stop_token_ids=[300]).usage.completion_tokens
    == 1 < api.call(allowed_token_ids=[300]).usage.completion_tokens,
    "presence_penalty": lambda api, _: api.text(max_tokens=32, presence_penalty=2.0) != api.text(max_tokens=32),
    "frequency_penalty": lambda api, _: api.text(max_tokens=32, frequency_penalty=2.0) != api.text(max_tokens=32),
    "repetition_penalty": lambda api, _: api.text(max_tokens=32, repetition_penalty=2.0) != api.text(max_tokens=32),
    "logit_bias": lambda api, _: api.text(logit_bias={"300": 100}) == api.tok.decode([300] * 8),
    "allowed_token_ids": lambda api, _: api.text(allowed_token_ids=[300]) == api.tok.decode([300] * 8),
    "user": lambda api, caplog: api.logged(caplog, '"user": "end-user-7"', user="end-user-7"),
    # who the request is for: in its usage record, as `user`
    "safety_identifier": lambda api, caplog: api.logged(caplog, '"safety_identifier": "hash-7"',
                                                        safety_identifier="hash-7"),
    "metadata": lambda api, caplog: api.logged(caplog, '"metadata": {"run": "7"}', metadata={"run": "7"})
    and api.refused("metadata", metadata={str(i): "x" for i in range(17)}),
    # the admission order among waiting requests (tests/cluster/control: a flex request waits behind default
    # ones) and the worker routed to: carried to the scheduler, and in the usage record
    "service_tier": lambda api, caplog: api.logged(caplog, '"service_tier": "flex"', service_tier="flex")
    and api.refused("priority", service_tier="flex", priority=2),
    "priority": lambda api, caplog: api.logged(caplog, '"priority": -3', priority=-3),
    "prompt_cache_key": lambda api, caplog: api.logged(caplog, '"prompt_cache_key": "conv-7"',
                                                       prompt_cache_key="conv-7"),
    "ignore_eos": lambda api, _: api.call(logit_bias={str(EOS): 100}, ignore_eos=False).usage.completion_tokens == 1
    and api.call(logit_bias={str(EOS): 100}).usage.completion_tokens == 8,
    "min_tokens": lambda api, _: api.call(logit_bias={str(EOS): 100}, ignore_eos=False, min_tokens=3)
    .usage.completion_tokens == 4,
    "timeout": lambda api, _: api.fails(openai.APIStatusError, max_tokens=1000, timeout=0.001),
    "best_of": lambda api, _: api.refused("best_of", best_of=2),
    "response_format": lambda api, _: json.loads(api.text(max_tokens=20, response_format={
        "type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}})) == {"a": 1},
    "guided_json": lambda api, _: json.loads(api.text(max_tokens=20, guided_json=SCHEMA)) == {"a": 1},
    "guided_regex": lambda api, _: api.text(guided_regex="(ab){3}") == "ababab",
    "guided_choice": lambda api, _: api.text(guided_choice=["yes", "no"]) in ("yes", "no"),
    "guided_grammar": lambda api, _: api.text(guided_grammar='root ::= "x" "y"') == "xy",
    "structured_outputs": lambda api, _: api.text(structured_outputs={"choice": ["p", "q"]}) in ("p", "q"),
    "skip_special_tokens": lambda api, _: api.text(allowed_token_ids=[BOS]) == "" and api.text(
        allowed_token_ids=[BOS], skip_special_tokens=False) == api.tok.decode([BOS] * 8),
    "truncate_prompt_tokens": lambda api, _: _truncated(api),
    # the opposite of the endpoint's default: chat adds a BOS (its template has one), completions drops it
    "add_special_tokens": lambda api, _: api.call(add_special_tokens=api.is_chat).usage.prompt_tokens
    == len(api.prompt_ids(add_special_tokens=api.is_chat)) == len(api.prompt_ids()) + (1 if api.is_chat else -1),
    "max_tokens": lambda api, _: _max_tokens(api, "max_tokens"),
    "return_tokens_as_token_ids": lambda api, _: _token_ids(api),
    "prompt_logprobs": lambda api, _: len(api.call(prompt_logprobs=1).choices[0].model_extra["prompt_logprobs"])
    == len(api.prompt_ids()),
}
COMPLETIONS = {
    **COMMON,
    "prompt": lambda api, _: api.call(prompt="Other words").usage.prompt_tokens == len(api.tok.encode("Other words")),
    "logprobs": lambda api, _: len(api.call(logprobs=2).choices[0].logprobs.tokens) == 8,
    "echo": lambda api, _: api.text(echo=True) == PROMPT + api.text(),
}
ANSWERED = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hel"}]
TOOL = {"type": "function", "function": {"name": "f", "parameters": SCHEMA}}
CHAT = {
    **COMMON,
    "messages": lambda api, _: api.call(messages=ANSWERED).usage.prompt_tokens == len(api.prompt_ids(messages=ANSWERED)),
    "max_completion_tokens": lambda api, _: _max_tokens(api, "max_completion_tokens"),
    "logprobs": lambda api, _: len(api.call(logprobs=True).choices[0].logprobs.content) == 8,
    "top_logprobs": lambda api, _: {len(t.top_logprobs) for t in api.call(logprobs=True, top_logprobs=2).choices[0]
                                    .logprobs.content} == {2} and api.refused("top_logprobs", top_logprobs=2),
    "tools": lambda api, _: api.refused("tool_choice", tools=[TOOL]),  # "auto" needs a parser, this server has none
    "tool_choice": lambda api, _: api.call(tools=[TOOL], tool_choice="required", max_tokens=30).choices[0]
    .finish_reason == "tool_calls",
    "parallel_tool_calls": lambda api, _: len(api.call(tools=[TOOL], tool_choice="required", max_tokens=30,
                                                       parallel_tool_calls=False).choices[0].message.tool_calls) == 1,
    "add_generation_prompt": lambda api, _: api.call(add_generation_prompt=False).usage.prompt_tokens
    == len(api.prompt_ids(add_generation_prompt=False)) < len(api.prompt_ids()),
    "continue_final_message": lambda api, _: api.call(messages=ANSWERED, add_generation_prompt=False,
                                                      continue_final_message=True).usage.prompt_tokens
    == len(api.prompt_ids(messages=ANSWERED, add_generation_prompt=False, continue_final_message=True))
    and api.refused("continue_final_message", messages=ANSWERED, continue_final_message=True),
    "chat_template_kwargs": lambda api, _: api.refused("chat_template_kwargs.enable_thinking",
                                                       chat_template_kwargs={"enable_thinking": False}),
    "store": lambda api, _: _stored(api),
    # template variables: this model's template reads neither (test_template_fields.py: one that does)
    "reasoning_effort": lambda api, _: api.refused("reasoning_effort", reasoning_effort="low"),
    "verbosity": lambda api, _: api.refused("verbosity", verbosity="low"),
}


def test_every_field_has_a_decision():
    """A field added to a request model must get a row here: honoured and seen, or refused by name."""
    assert set(CompletionRequest.model_fields) == set(COMPLETIONS)
    assert set(ChatCompletionRequest.model_fields) == set(CHAT)


@pytest.mark.parametrize("endpoint, field", [("completions", f) for f in COMPLETIONS] + [("chat", f) for f in CHAT])
def test_each_field_is_honoured_or_refused(apis, endpoint, field, caplog):
    api = apis[endpoint]
    assert (CHAT if api.is_chat else COMPLETIONS)[field](api, caplog) is True


def _asking(neutral: tuple):
    """A value of a refused field that asks for something (not one of its neutral values)."""
    kind = type(neutral[0]) if neutral else None
    if kind is bool:
        return not neutral[0]
    return {float: 0.5, int: 5, list: ["x"], dict: {"x": 1}, str: "other"}.get(kind, "x")


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_fields_not_served_are_refused_by_name(apis, endpoint):
    api = apis[endpoint]
    declared = ChatCompletionRequest.model_fields if api.is_chat else CompletionRequest.model_fields
    for name, neutral in REFUSED.items():
        if name in declared:
            continue  # completions' echo is served
        with pytest.raises(openai.BadRequestError) as bad:
            api.call(**{name: _asking(neutral)})
        assert bad.value.body["param"] == name and f"{name} is not supported by this server" in bad.value.body["message"]
        for value in (None, *neutral):  # asking for nothing is fine
            assert api.call(max_tokens=1, **{name: value}).usage.completion_tokens == 1, (name, value)


def test_unknown_fields_are_refused_by_name(apis):
    api = apis["chat"]
    assert api.refused("foo_bar", foo_bar=1, baz=2)
    assert api.refused("stream_options.foo", stream=True, stream_options={"include_usage": True, "foo": 1})
    assert api.refused("structured_outputs.structural_tag", structured_outputs={"structural_tag": "x"})
    assert api.call(max_tokens=1, foo_bar=None).usage.completion_tokens == 1  # null asks for nothing
    with pytest.raises(openai.BadRequestError) as bad:
        api.call(foo_bar=1, baz=2)
    assert "foo_bar, baz" in bad.value.body["message"] and "ingress.unknown_fields" in bad.value.body["message"]


def test_unknown_fields_can_be_accepted_and_logged(server, caplog):
    """`ingress.unknown_fields: accept` (a second ingress on the same cluster): an unknown field is logged
    once per request, at WARNING; a refused field is still refused."""
    cluster, _ = server
    with running(make_server(cluster, "127.0.0.1", 0, IngressSection(unknown_fields="accept"))) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        api = Api(client, None, chat=False)
        with caplog.at_level(logging.WARNING, logger="tandem.ingress"):
            assert api.call(max_tokens=2, foo_bar=1, vendor_x={"y": 1}).usage.completion_tokens == 2
        warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warned) == 1 and "foo_bar, vendor_x" in warned[0], warned
        assert api.refused("use_beam_search", use_beam_search=True)


def test_tokenize_takes_the_chat_template_options(server, apis):
    url, api = server[1], apis["chat"]
    for messages, options in ((ASK, {"add_generation_prompt": False}),
                              (ANSWERED, {"add_generation_prompt": False, "continue_final_message": True})):
        tokens = httpx.post(url + "/tokenize", json={"messages": messages, **options}).json()["tokens"]
        assert tokens == api.prompt_ids(messages=messages, **options)
    for body, param in (({"prompt": "x", "foo": 1}, "foo"), ({"prompt": "x", "add_generation_prompt": False},
                                                             "add_generation_prompt")):
        bad = httpx.post(url + "/tokenize", json=body)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == param, bad.text


def test_chat_template_kwargs_reach_the_template(engine):
    """A kwarg the template reads changes the prompt; one it does not read, or one the server sets, is a 400."""
    template = "{% if enable_thinking %}<think>{% endif %}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    variables = template_variables(template)
    thinking = TemplateOptions(kwargs={"enable_thinking": True})
    thinking.check(variables, ASK)
    text = engine.tokenizer.decode(render(engine.tokenizer, template, ASK, None, thinking))
    assert text == "<think>Hello there" and engine.tokenizer.decode(
        render(engine.tokenizer, template, ASK, None, TemplateOptions())) == "Hello there"
    for key in ("reasoning", "messages", "bos_token"):
        with pytest.raises(ApiError) as bad:
            TemplateOptions(kwargs={key: 1}).check(variables, ASK)
        assert bad.value.param == f"chat_template_kwargs.{key}"
