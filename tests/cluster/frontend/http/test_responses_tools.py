"""Function tools on `/v1/responses`, as the OpenAI Agents SDK uses them: every key of a tool, a
`function_call` item and a `function_call_output` item (the tables of responses_request.py, read from the
code, so a key added later without a decision here fails) is honoured, seen as the same prompt the chat
route makes of the same conversation, or refused by name; a forced call comes back as a `function_call`
output item whose arguments follow the tool's schema, given back with its result it continues the
conversation, and streamed it arrives as the API's events, the same call as the whole answer.

A second ingress on the module's 1P+1D cluster, with the shipped chatml-tools template (the tiny model's
own has no tools) and the hermes parser, so `tool_choice: "auto"` is served too."""

from __future__ import annotations

import json
from pathlib import Path

import openai
import pytest

from cluster.control.config import IngressSection
from cluster.frontend.http.responses_request import CALL_KEYS, CALL_OUTPUT_KEYS, TOOL_KEYS
from cluster.frontend.http.server import make_server
from tests.cluster.frontend.http.test_request_fields import SCHEMA
from tests.helpers.http_server import MODEL, running

TEMPLATE = Path(__file__).resolve().parents[4] / "chat_templates" / "chatml-tools.jinja"
ASK = "What is a?"
TOOL = {"type": "function", "name": "f", "description": "Finds a.", "parameters": SCHEMA}
CHAT_TOOL = {"type": "function", "function": {"name": "f", "description": "Finds a.", "parameters": SCHEMA}}
CALL = {"type": "function_call", "call_id": "call_1", "name": "f", "arguments": '{"a": 1}'}
RESULT = {"type": "function_call_output", "call_id": "call_1", "output": "a is 1"}
CHAT_CALL = {"role": "assistant", "content": None, "tool_calls": [
    {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}]}
CHAT_RESULT = {"role": "tool", "tool_call_id": "call_1", "content": "a is 1"}


@pytest.fixture(scope="module")
def client(server):
    ingress = IngressSection(chat_template=str(TEMPLATE), tool_call_parser="hermes")
    with running(make_server(server[0], "127.0.0.1", 0, ingress)) as url:
        yield openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)


def respond(client, **body):
    fields = {"input": ASK, "max_output_tokens": 30, "temperature": 0, "tools": [TOOL], **body}
    return client.responses.create(model=MODEL, stream=fields.pop("stream", False), extra_body=fields)


def input_tokens(client, items: list[dict], tools=(TOOL,)) -> int:
    return respond(client, input=items, tools=list(tools), max_output_tokens=1).usage.input_tokens


def chat_tokens(client, messages: list[dict], tools=(CHAT_TOOL,)) -> int:
    return client.chat.completions.create(model=MODEL, messages=messages, tools=list(tools), max_tokens=1,
                                          tool_choice="auto").usage.prompt_tokens


def refused(client, param: str, **body) -> bool:
    with pytest.raises(openai.BadRequestError) as bad:
        respond(client, **body)
    assert bad.value.body["param"] == param and param in bad.value.body["message"], bad.value.body
    return True


def round_trip(client, call=CALL, result=RESULT) -> list[dict]:
    return [{"role": "user", "content": ASK}, call, result]


def reads_as_chat(client, call=CALL, result=RESULT) -> bool:
    """A conversation with a call and its result is the prompt chat makes of the same messages."""
    return input_tokens(client, round_trip(client, call, result)) == chat_tokens(
        client, [{"role": "user", "content": ASK}, CHAT_CALL, CHAT_RESULT])


def bad(client, item: str, key: str, value) -> bool:
    call, result = dict(CALL), dict(RESULT)
    (call if item == "call" else result)[key] = value
    return refused(client, f"input[{1 if item == 'call' else 2}].{key}", input=round_trip(client, call, result))


def forced(client, tool=TOOL, **body):
    out = respond(client, tools=[tool], tool_choice="required", **body)
    (call,) = [item for item in out.output if item.type == "function_call"]
    return call


CALLS = {
    "type": lambda c: reads_as_chat(c),
    "call_id": lambda c: reads_as_chat(c) and bad(c, "call", "call_id", 7),
    "name": lambda c: input_tokens(c, round_trip(c, {**CALL, "name": "longer_name"})) != input_tokens(
        c, round_trip(c)) and bad(c, "call", "name", 7),
    "arguments": lambda c: input_tokens(c, round_trip(c, {**CALL, "arguments": '{"a": 11}'})) != input_tokens(
        c, round_trip(c)) and bad(c, "call", "arguments", {"a": 1}),
    "id": lambda c: reads_as_chat(c, {**CALL, "id": "fc_1"}) and bad(c, "call", "id", 7),
    "status": lambda c: reads_as_chat(c, {**CALL, "status": "completed"}) and bad(c, "call", "status", "lost"),
}
CALL_OUTPUTS = {
    "type": lambda c: reads_as_chat(c),
    "call_id": lambda c: reads_as_chat(c) and bad(c, "result", "call_id", 7),
    "output": lambda c: reads_as_chat(c, result={**RESULT, "output": [{"type": "input_text", "text": "a is 1"}]})
    and bad(c, "result", "output", 7),
    "id": lambda c: reads_as_chat(c, result={**RESULT, "id": "fco_1"}) and bad(c, "result", "id", 7),
    "status": lambda c: reads_as_chat(c, result={**RESULT, "status": "completed"}) and bad(c, "result", "status", "x"),
}
TOOLS = {
    "type": lambda c: forced(c).name == "f" and refused(c, "tools[0].type", tools=[{**TOOL, "type": "file_search"}]),
    "name": lambda c: forced(c, {**TOOL, "name": "g"}).name == "g" and refused(c, "tools[0].name", tools=[
        {**TOOL, "name": 7}]),
    "description": lambda c: input_tokens(c, [{"role": "user", "content": ASK}]) == chat_tokens(
        c, [{"role": "user", "content": ASK}]) != input_tokens(c, [{"role": "user", "content": ASK}], tools=[
            {**TOOL, "description": "Finds a, and more."}]) and refused(c, "tools[0].description", tools=[
                {**TOOL, "description": 7}]),
    "parameters": lambda c: json.loads(forced(c).arguments) == {"a": 1} and refused(c, "tools[0].parameters", tools=[
        {**TOOL, "parameters": "x"}]),
    # whether the arguments must follow the schema: the grammar makes them follow it either way, as on chat
    "strict": lambda c: json.loads(forced(c, {**TOOL, "strict": False}).arguments) == {"a": 1} and refused(
        c, "tools[0].strict", tools=[{**TOOL, "strict": "yes"}]),
}


def test_every_key_has_a_decision():
    assert set(CALL_KEYS) == set(CALLS) and set(CALL_OUTPUT_KEYS) == set(CALL_OUTPUTS) and set(TOOL_KEYS) == set(TOOLS)


@pytest.mark.parametrize("table, key", [("call", k) for k in CALLS] + [("output", k) for k in CALL_OUTPUTS]
                         + [("tool", k) for k in TOOLS])
def test_each_key_is_honoured_or_refused(client, table, key):
    assert {"call": CALLS, "output": CALL_OUTPUTS, "tool": TOOLS}[table][key](client) is True


def test_a_forced_call_given_back_with_its_result_continues_the_conversation(client):
    """The SDK's round trip: `input += response.output`, then the call's output."""
    first = respond(client, tool_choice="required")
    (call,) = first.output
    assert (call.type, call.name, call.status, json.loads(call.arguments)) == ("function_call", "f", "completed", {"a": 1})
    given = [{"role": "user", "content": ASK}, *[item.model_dump(exclude_none=True) for item in first.output],
             {"type": "function_call_output", "call_id": call.call_id, "output": "a is 1"}]
    second = respond(client, input=given, tool_choice="auto", max_output_tokens=5)
    assert second.status == "incomplete" and second.output[0].type == "message" and second.output_text
    chat_call = {"role": "assistant", "content": None, "tool_calls": [
        {"id": call.call_id, "type": "function", "function": {"name": "f", "arguments": call.arguments}}]}
    assert second.usage.input_tokens == chat_tokens(client, [
        {"role": "user", "content": ASK}, chat_call, {"role": "tool", "tool_call_id": call.call_id, "content": "a is 1"}])


def test_a_streamed_call_is_the_whole_answers_call(client):
    whole = forced(client, max_output_tokens=80)
    events = list(respond(client, tool_choice="required", stream=True, max_output_tokens=80))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.output_item.added"] and kinds[-3:] == [
        "response.function_call_arguments.done", "response.output_item.done", "response.completed"], kinds
    deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    assert len(deltas) >= 2 and "".join(deltas) == whole.arguments == events[-3].arguments
    added, done, final = events[1].item, events[-2].item, events[-1].response
    assert (added.type, added.name, added.status) == ("function_call", "f", "in_progress")
    assert (done.name, done.arguments, done.status) == ("f", whole.arguments, "completed")
    assert [item.type for item in final.output] == ["function_call"] and final.output[0].call_id == done.call_id
    assert [e.sequence_number for e in events] == list(range(len(events)))


def test_auto_answers_in_text_or_calls(client):
    """With a parser, "auto" is served; the tiny random model answers in text."""
    out = respond(client, tool_choice="auto", max_output_tokens=4)
    assert out.status == "incomplete" and [item.type for item in out.output] == ["message"] and out.output_text
    assert out.tool_choice == "auto" and out.tools[0].name == "f"
