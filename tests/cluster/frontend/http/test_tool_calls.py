"""Tool calls without a model: the parsers read calls back from answers (or leave text alone), the
conversation reaches the template with arguments as objects, and the requests that cannot work are a 400
naming the field (against the live tiny-model server, which has no tool-call parser configured)."""

from __future__ import annotations

import json

import openai
import pytest

from cluster.frontend.http import tool_calls
from cluster.frontend.http.protocol import ApiError
from tests.helpers.http_server import MODEL

TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


def test_hermes_parser():
    text = 'Let me look.\n<tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>\n<tool_call>\n{"name": "g", ' \
           '"arguments": {}}\n</tool_call>'
    content, calls = tool_calls.parse(text, "hermes", forced=False)
    assert content == "Let me look."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [("f", {"x": 1}), ("g", {})]
    assert len({c["id"] for c in calls}) == 2
    assert tool_calls.parse("<tool_call>not json</tool_call> plain", "hermes", False) == \
        ("<tool_call>not json</tool_call> plain", [])  # nothing parses: the text stays the answer


def test_llama3_json_parser_and_forced_calls():
    content, calls = tool_calls.parse('{"name": "f", "parameters": {"y": "z"}}', "llama3_json", forced=False)
    assert content is None and json.loads(calls[0]["function"]["arguments"]) == {"y": "z"}
    assert tool_calls.parse("just words", "llama3_json", False) == ("just words", [])
    content, calls = tool_calls.parse('{"name": "f", "arguments": {"a": [1]}}', None, forced=True)
    assert content is None and calls[0]["function"]["name"] == "f"
    cut = '{"name": "f", "argum'  # a forced call cut short by max_tokens: no call, the text as it is
    assert tool_calls.parse(cut, None, forced=True) == (cut, [])


def test_template_messages_take_arguments_as_objects():
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}
    (m,) = tool_calls.template_messages([{"role": "assistant", "content": None, "tool_calls": [call]}])
    assert m["tool_calls"][0]["function"]["arguments"] == {"x": 1} and "content" not in m
    with pytest.raises(ApiError, match="not JSON"):
        tool_calls.template_messages([{"role": "assistant", "tool_calls": [{"function": {"arguments": "{"}}]}])


@pytest.mark.parametrize("extra, words", [
    ({"tools": [TOOL]}, 'tool_choice "auto" needs a tool-call parser'),
    ({"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "'nope', which is not among"),
    ({"tool_choice": "required"}, "tool_choice needs tools"),
    ({"tools": [TOOL], "tool_choice": "required", "response_format": {"type": "json_object"}}, "cannot be combined"),
])
def test_impossible_tool_requests_are_a_400(server, extra, words):
    client = openai.OpenAI(base_url=server[1] + "/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4, **extra)
    assert bad.value.body["param"] == "tool_choice" and words in bad.value.body["message"], bad.value.body


def test_tool_choice_none_answers_in_text(server):
    client = openai.OpenAI(base_url=server[1] + "/v1", api_key="unused", max_retries=0)
    out = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                         tools=[TOOL], tool_choice="none", temperature=0)
    assert out.choices[0].message.content and not out.choices[0].message.tool_calls
