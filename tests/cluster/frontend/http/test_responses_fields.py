"""No field of a `/v1/responses` request is accepted without an effect, as test_request_fields.py shows for
chat and completions. Every field of `ResponsesRequest` and every key of the objects inside it (input items,
content parts, `text`, `text.format`: the tables of responses_request.py, read from the code, so a key added
later without a decision here fails) is sent to the live 1P+1D server through the official client with a
value that asks for something, and its effect is seen, or it is a 400 naming it. The Responses API's fields
this server does not serve (`responses_request.REFUSED`) are refused by name unless neutral, and an unknown
field or key, at the top or inside an item, a part or `text`, is a 400 naming it unless
`ingress.unknown_fields: accept` (then it is logged)."""

from __future__ import annotations

import json
import logging

import openai
import pytest

from cluster.control.config import IngressSection
from cluster.frontend.http.responses_request import (
    FORMAT_KEYS,
    ITEM_KEYS,
    PART_KEYS,
    REASONING_KEYS,
    REFUSED,
    TEXT_KEYS,
    ResponsesRequest,
)
from cluster.frontend.http.server import make_server
from tests.cluster.frontend.http.test_request_fields import SCHEMA, _asking
from tests.helpers.field_probe import FieldProbe
from tests.helpers.http_server import MODEL, running

ASK = "Hello there"
TOOL = {"type": "function", "name": "f", "parameters": SCHEMA}


def _format(kind: str, **keys) -> dict:
    return {"format": {"type": kind, **({"name": "a", "schema": SCHEMA} if kind == "json_schema" else {}), **keys}}


class Api(FieldProbe):
    """`/v1/responses` through the official client, greedy unless a call says otherwise; `chat` the chat
    route on the same server, for what the same conversation is there."""

    def __init__(self, client: openai.OpenAI):
        self.client = client

    def call(self, **body):
        fields = {"input": ASK, "max_output_tokens": 8, "temperature": 0, **body}
        sdk = {k: fields.pop(k) for k in ("model", "stream") if k in fields}  # the client reads these
        sdk.setdefault("model", MODEL)
        return self.client.responses.create(extra_body=fields, **sdk)

    def text(self, **body) -> str:
        return self.call(**body).output_text

    def sampled(self, **body) -> str:
        return self.text(**{"temperature": 1.0, "seed": 3, "max_output_tokens": 16, **body})

    def input_tokens(self, **body) -> int:
        return self.call(max_output_tokens=1, **body).usage.input_tokens

    def chat_tokens(self, messages: list[dict]) -> int:
        """Prompt tokens of `messages` on the chat route."""
        return self.client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1).usage.prompt_tokens


@pytest.fixture(scope="module")
def api(server) -> Api:
    return Api(openai.OpenAI(base_url=server[1] + "/v1", api_key="unused", max_retries=0))


def _streamed(api: Api) -> bool:
    events = list(api.call(stream=True))
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    return events[0].type == "response.created" and events[-1].type == "response.incomplete" and \
        len(deltas) >= 2 and "".join(deltas) == api.text()


def _given_back(api: Api) -> list[dict]:
    """An earlier answer as the SDK gives it back (`input += response.output`): its items and parts carry
    `id`, `status`, `annotations` and `logprobs`."""
    out = api.call()
    items = [item.model_dump(exclude_none=True) for item in out.output]
    assert {"id", "status"} <= set(items[0]) and "annotations" in items[0]["content"][0], items
    items[0]["content"][0].setdefault("logprobs", [])  # as the API's output text has them (this server sends none)
    return [{"role": "user", "content": ASK}, *items, {"role": "user", "content": "And then?"}]


def _given_back_reads_as_chat(api: Api) -> bool:
    conversation = _given_back(api)
    said = conversation[1]["content"][0]["text"]
    as_chat = [conversation[0], {"role": "assistant", "content": said}, conversation[2]]
    return api.input_tokens(input=conversation) == api.chat_tokens(as_chat)


def _bad_in_given_back(api: Api, key: str, value) -> bool:
    conversation = _given_back(api)
    where = conversation[1] if key in ITEM_KEYS else conversation[1]["content"][0]
    where[key] = value
    path = "input[1]" if key in ITEM_KEYS else "input[1].content[0]"
    return api.refused(f"{path}.{key}", input=conversation)


def _parts(api: Api, kind: str) -> bool:
    """Text parts reach the prompt as the chat route joins them."""
    parts = [{"type": kind, "text": "Hello"}, {"type": kind, "text": "there"}]
    chat = [{"role": "user", "content": [{"type": "text", "text": "Hello"}, {"type": "text", "text": "there"}]}]
    return api.input_tokens(input=[{"role": "user", "content": parts}]) == api.chat_tokens(chat)


def _schema_holds(api: Api, **keys) -> bool:
    return json.loads(api.text(max_output_tokens=20, text=_format("json_schema", **keys))) == {"a": 1}


def _called(api: Api, **body) -> list[str]:
    """The functions a greedy answer called, when offered TOOL (its arguments parse as JSON)."""
    out = api.call(tools=[TOOL], max_output_tokens=30, **body)
    calls = [item for item in out.output if item.type == "function_call"]
    assert all(isinstance(json.loads(c.arguments), dict) and c.call_id for c in calls), calls
    return [c.name for c in calls]


def _logprobs(api: Api, top: int = 0) -> bool:
    """`include: ["message.output_text.logprobs"]`: a logprob per output token, with `top` alternatives,
    whole and streamed alike (the chat route's, for the same conversation)."""
    include = ["message.output_text.logprobs"]
    part = api.call(include=include, top_logprobs=top).output[0].content[0]
    streamed = [lp for e in api.call(include=include, top_logprobs=top, stream=True)
                if e.type == "response.output_text.delta" for lp in e.logprobs]
    chat = api.client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": ASK}], max_tokens=8,
                                              temperature=0, logprobs=True, top_logprobs=top).choices[0].logprobs
    seen = [(t.token, round(t.logprob, 4), len(t.top_logprobs)) for t in part.logprobs]
    return len(part.logprobs) == 8 and "".join(t.token for t in part.logprobs) == part.text and seen == [
        (t.token, round(t.logprob, 4), len(t.top_logprobs)) for t in streamed] == [
        (t.token, round(t.logprob, 4), top) for t in chat.content]


def _continued(api: Api) -> bool:
    """A stored response continued: its input and output come before the new input, as if sent again."""
    first = api.call()
    again = api.call(previous_response_id=first.id, input="And then?", max_output_tokens=1)
    given = [{"role": "user", "content": ASK}, *[item.model_dump(exclude_none=True) for item in first.output],
             {"role": "user", "content": "And then?"}]
    return again.previous_response_id == first.id and again.usage.input_tokens == api.input_tokens(input=given)


def _stored(api: Api) -> bool:
    """Kept unless `store: false` (OpenAI's default), read back by id, and deleted."""
    kept, not_kept = api.call(), api.call(store=False)
    with pytest.raises(openai.NotFoundError):
        api.client.responses.retrieve(not_kept.id)
    read = api.client.responses.retrieve(kept.id)
    api.client.responses.delete(kept.id)
    with pytest.raises(openai.NotFoundError):
        api.client.responses.retrieve(kept.id)
    return kept.store and not not_kept.store and read.output_text == kept.output_text and read.id == kept.id


def _max_output_tokens(api: Api) -> bool:
    return api.call(max_output_tokens=5).usage.output_tokens == 5 and \
        api.refused("max_output_tokens", max_output_tokens=4096)


# field -> a check that its value was honoured (True) or refused by name (`api.refused`, True).
FIELDS = {
    "model": lambda api, _: api.fails(openai.NotFoundError, model="gpt-17"),
    "input": lambda api, _: api.input_tokens(input="Other words") == api.chat_tokens(
        [{"role": "user", "content": "Other words"}]) != api.input_tokens(),
    "instructions": lambda api, _: api.input_tokens(instructions="Be brief.") == api.chat_tokens(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": ASK}]) > api.input_tokens(),
    "max_output_tokens": lambda api, _: _max_output_tokens(api),
    "temperature": lambda api, _: api.sampled() != api.text(max_output_tokens=16),
    "top_p": lambda api, _: api.sampled(top_p=1e-9) == api.text(max_output_tokens=16),
    "seed": lambda api, _: api.sampled() == api.sampled() != api.sampled(seed=4),
    "stream": lambda api, _: _streamed(api),
    "text": lambda api, _: _schema_holds(api),
    # tools, tool_choice and the items and keys of a tool round trip: test_responses_tools.py, with a template
    # that renders them; here, as on chat, "auto" needs a parser (this server has none)
    "tools": lambda api, _: api.refused("tool_choice", tools=[TOOL]) and api.refused(
        "tools[0].type", tools=[{"type": "web_search"}], tool_choice="required"),
    "tool_choice": lambda api, _: _called(api, tool_choice="required") == ["f"] == _called(
        api, tool_choice={"type": "function", "name": "f"}) and api.refused("tool_choice", tools=[TOOL],
                                                                           tool_choice={"type": "web_search"}),
    "parallel_tool_calls": lambda api, _: _called(api, tool_choice="required", parallel_tool_calls=False) == ["f"],
    "previous_response_id": lambda api, _: _continued(api) and api.refused("previous_response_id",
                                                                           previous_response_id="resp_1"),
    "store": lambda api, _: _stored(api),
    "background": lambda api, _: api.refused("background", background=True),
    "user": lambda api, caplog: api.logged(caplog, '"user": "end-user-7"', user="end-user-7"),
    "safety_identifier": lambda api, caplog: api.logged(caplog, '"safety_identifier": "hash-7"',
                                                        safety_identifier="hash-7"),
    "metadata": lambda api, caplog: api.call(metadata={"run": "7"}).metadata == {"run": "7"} and api.logged(
        caplog, '"metadata": {"run": "7"}', metadata={"run": "7"}),
    "service_tier": lambda api, caplog: api.call(service_tier="flex").service_tier == "flex" and api.logged(
        caplog, '"service_tier": "flex"', service_tier="flex"),
    "prompt_cache_key": lambda api, caplog: api.logged(caplog, '"prompt_cache_key": "conv-7"',
                                                       prompt_cache_key="conv-7"),
    "reasoning": lambda api, _: REASONING["effort"](api),
    "include": lambda api, _: _logprobs(api) and api.refused("include[0]", include=["reasoning.encrypted_content"]),
    "top_logprobs": lambda api, _: _logprobs(api, top=2) and api.refused("top_logprobs", top_logprobs=2),
}
ITEMS = {
    "type": lambda api: api.input_tokens(input=[{"type": "message", "role": "user", "content": ASK}])
    == api.input_tokens() and api.refused("input[0].type", input=[{"type": "reasoning", "summary": []}]),
    "role": lambda api: api.input_tokens(input=[{"role": "developer", "content": "Be brief."},
                                                {"role": "user", "content": ASK}])
    == api.input_tokens(instructions="Be brief.") and api.refused("input[0].role", input=[{"role": "tool",
                                                                                          "content": ASK}]),
    "content": lambda api: _parts(api, "input_text"),
    "id": lambda api: _given_back_reads_as_chat(api) and _bad_in_given_back(api, "id", 7),
    "status": lambda api: _given_back_reads_as_chat(api) and _bad_in_given_back(api, "status", "lost"),
    "phase": lambda api: api.refused("input[0].phase", input=[{"role": "user", "content": ASK, "phase": "commentary"}]),
}
PARTS = {
    "type": lambda api: _parts(api, "output_text") and _parts(api, "text") and api.refused(
        "input[0].content[0].type", input=[{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]),
    "text": lambda api: _parts(api, "input_text"),
    "annotations": lambda api: _given_back_reads_as_chat(api) and _bad_in_given_back(api, "annotations", "x"),
    "logprobs": lambda api: _given_back_reads_as_chat(api) and _bad_in_given_back(api, "logprobs", 1),
    "prompt_cache_breakpoint": lambda api: api.refused("input[0].content[0].prompt_cache_breakpoint", input=[
        {"role": "user", "content": [{"type": "input_text", "text": ASK, "prompt_cache_breakpoint": {}}]}]),
}
TEXT = {
    "format": lambda api: _schema_holds(api) and api.text(text=_format("text")) == api.text(),
    "verbosity": lambda api: api.refused("text.verbosity", text={"verbosity": "high"}),  # as reasoning.effort
}
REASONING = {
    # a template variable this model's template never reads (test_template_fields.py: one that does)
    "effort": lambda api: api.refused("reasoning.effort", reasoning={"effort": "low"}) and api.refused(
        "reasoning.effort", reasoning={"effort": "extreme"}),
    "summary": lambda api: api.refused("reasoning.summary", reasoning={"summary": "auto"}),
    "generate_summary": lambda api: api.refused("reasoning.generate_summary", reasoning={"generate_summary": "auto"}),
}
FORMATS = {
    "type": lambda api: api.text(max_output_tokens=3, text=_format("json_object")).startswith("{") and not api.text(
        max_output_tokens=3).startswith("{") and api.refused("text.format.type", text=_format("yaml")),
    "schema": lambda api: _schema_holds(api) and api.refused("text.format.schema", text={"format": {
        "type": "json_schema", "name": "a"}}),
    # a label, a hint to the model, and whether to enforce: chat's response_format takes them, and the
    # grammar is the schema whatever they say (protocol.JsonSchemaFormat)
    "name": lambda api: _schema_holds(api, name="other") and api.refused("text.format.name", text=_format(
        "json_schema", name=7)),
    "description": lambda api: _schema_holds(api, description="An object") and api.refused(
        "text.format.description", text=_format("json_schema", description=7)),
    "strict": lambda api: _schema_holds(api, strict=False) and api.refused("text.format.strict", text=_format(
        "json_schema", strict="yes")),
}


def test_every_field_and_key_has_a_decision():
    """A field added to the request model, or a key to a table of responses_request.py, must get a row here."""
    assert set(ResponsesRequest.model_fields) == set(FIELDS)
    assert set(ITEM_KEYS) == set(ITEMS) and set(PART_KEYS) == set(PARTS) and set(TEXT_KEYS) == set(TEXT)
    assert set().union(*FORMAT_KEYS.values()) == set(FORMATS) and set(REASONING_KEYS) == set(REASONING)


@pytest.mark.parametrize("field", FIELDS)
def test_each_field_is_honoured_or_refused(api, field, caplog):
    assert FIELDS[field](api, caplog) is True


@pytest.mark.parametrize("where, key", [("item", k) for k in ITEMS] + [("part", k) for k in PARTS]
                         + [("text", k) for k in TEXT] + [("format", k) for k in FORMATS]
                         + [("reasoning", k) for k in REASONING])
def test_each_key_inside_is_honoured_or_refused(api, where, key):
    tables = {"item": ITEMS, "part": PARTS, "text": TEXT, "format": FORMATS, "reasoning": REASONING}
    assert tables[where][key](api) is True


def test_fields_not_served_are_refused_by_name(api):
    for name, neutral in REFUSED.items():
        with pytest.raises(openai.BadRequestError) as bad:
            api.call(**{name: _asking(neutral)})
        body = bad.value.body
        assert body["param"] == name and f"{name} is not supported by this server" in body["message"], body
        for value in (None, *neutral):  # asking for nothing is fine
            assert api.call(max_output_tokens=1, **{name: value}).usage.output_tokens == 1, (name, value)


def test_unknown_fields_and_keys_are_refused_by_name(api):
    assert api.refused("foo_bar", foo_bar=1)
    assert api.refused("input[0].foo", input=[{"role": "user", "content": ASK, "foo": 1}])
    assert api.refused("input[0].content[0].foo", input=[{"role": "user", "content": [
        {"type": "input_text", "text": ASK, "foo": 1}]}])
    assert api.refused("text.foo", text={"format": {"type": "text"}, "foo": 1})
    assert api.refused("text.format.foo", text=_format("json_schema", foo=1))
    # a schema beside json_object, not json_schema, would do nothing
    assert api.refused("text.format.schema", text={"format": {"type": "json_object", "schema": SCHEMA}})
    assert api.call(max_output_tokens=1, foo_bar=None, input=[{"role": "user", "content": ASK, "foo": None}]
                    ).usage.output_tokens == 1  # null asks for nothing
    with pytest.raises(openai.BadRequestError) as bad:
        api.call(foo_bar=1, input=[{"role": "user", "content": ASK, "foo": 1}])
    message = bad.value.body["message"]
    assert "foo_bar, input[0].foo" in message and "ingress.unknown_fields" in message, message


def test_unknown_fields_and_keys_can_be_accepted_and_logged(server, caplog):
    """`ingress.unknown_fields: accept` (a second ingress on the same cluster): unknown fields and keys are
    logged once per request, at WARNING; a field the API defines and this server does not serve is still
    refused."""
    with running(make_server(server[0], "127.0.0.1", 0, IngressSection(unknown_fields="accept"))) as url:
        api = Api(openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0))
        with caplog.at_level(logging.WARNING, logger="tandem.ingress"):
            assert api.call(max_output_tokens=2, foo_bar=1, input=[{"role": "user", "content": ASK, "foo": 1}],
                            text={"format": {"type": "text", "bar": 2}}).usage.output_tokens == 2
        warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warned) == 1 and "foo_bar, input[0].foo, text.format.bar" in warned[0], warned
        assert api.refused("include[0]", include=["reasoning.encrypted_content"])
