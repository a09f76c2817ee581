"""Tool calls without a model: the parsers read calls back from answers (or leave text alone), the
conversation reaches the template with arguments as objects, the shipped chatml-tools template writes
past calls' arguments as JSON once, and the requests that cannot work are a 400 naming the field (against
the live tiny-model server, which has no tool-call parser configured)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import openai
import pytest

from transformers import AutoTokenizer

from actors.engine.text.tokenizer import DEFAULT_TOKENIZER_DIR
from cluster.frontend.http import tool_calls
from cluster.frontend.http.chat_template import TemplateOptions, render
from cluster.frontend.http.protocol import ApiError
from tests.helpers.http_server import MODEL

TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
TEMPLATE = (Path(__file__).resolve().parents[4] / "chat_templates" / "chatml-tools.jinja").read_text()
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


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
    cut = '{"name": "f", "argum'  # cut short by max_tokens after its name: the call as far as it is written
    content, calls = tool_calls.parse(cut, None, forced=True)
    assert content is None and [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == [("f", "")]
    assert tool_calls.parse('{"na', None, forced=True) == ('{"na', [])  # before its name: text


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


def test_parallel_tool_calls_false_makes_the_first_call_only():
    text = '<tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call><tool_call>{"name": "g", "arguments": {}}</tool_call>'
    assert [c["function"]["name"] for c in tool_calls.parse(text, "hermes", False)[1]] == ["f", "g"]
    assert [c["function"]["name"] for c in tool_calls.parse(text, "hermes", False, one=True)[1]] == ["f"]


def test_a_two_turn_tool_conversation_through_chatml_tools_keeps_dict_arguments():
    """Turn 1's call goes back to the template (as the server passes it, arguments an object, and in the
    wire form other servers pass on, a JSON string): both write the arguments as JSON once. A model that
    copies that history writes its second call the same way, and the hermes parser hands the client
    arguments that parse to a dict; so it does when the model writes them as a string holding JSON."""
    tokenizer = AutoTokenizer.from_pretrained(DEFAULT_TOKENIZER_DIR)
    ask = [{"role": "user", "content": "Weather in Paris, then in Lyon?"}]
    _, (first,) = tool_calls.parse('<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>',
                                   "hermes", False)
    assert json.loads(first["function"]["arguments"]) == {"city": "Paris"}
    history = ask + [{"role": "assistant", "content": None, "tool_calls": [first]},
                     {"role": "tool", "tool_call_id": first["id"], "content": '{"sky": "sunny"}'}]

    def text(messages) -> str:
        ids = render(tokenizer, TEMPLATE, messages, [WEATHER], TemplateOptions())
        return tokenizer.decode(ids)

    served = text(tool_calls.template_messages(history))
    assert served == text(history)  # arguments as a JSON string are written as they are
    (block,) = re.findall(r"<tool_call>.*?</tool_call>", served.split("<|im_start|>assistant\n")[1])
    assert block == '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    for second in (block.replace("Paris", "Lyon"),  # the model copies its history
                   '<tool_call>{"name": "get_weather", "arguments": "{\\"city\\": \\"Lyon\\"}"}</tool_call>'):
        _, (call,) = tool_calls.parse(second, "hermes", False)
        assert json.loads(call["function"]["arguments"]) == {"city": "Lyon"}, second
