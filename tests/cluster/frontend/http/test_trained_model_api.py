"""The API features that need a model that follows instructions, on SmolLM2-135M-Instruct (colocated,
one worker, the shipped chatml-tools template and the hermes parser) through the official `openai`
client and LangChain: `response_format` json_object gives a JSON object the model fills in itself
(unconstrained, the same model wraps its JSON in a markdown fence); tool_choice `required` and a named
function always return a call that parses, and streamed its arguments arrive in pieces that the SDK's
and LangChain's accumulators rebuild into the same call; an "auto" answer in text streams chunk by chunk
with the same content; a tool result continues the conversation."""

from __future__ import annotations

import json
from pathlib import Path

import openai
import pytest

from tests.helpers.cluster import load
from tests.helpers.http_server import serving

pytestmark = pytest.mark.slow  # the trained model behind a cluster

SERVED = "smollm2"
TEMPLATE = Path(__file__).resolve().parents[4] / "chat_templates" / "chatml-tools.jinja"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The local time in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30}}, "required": ["city"]}}}
ASK = [{"role": "user", "content": "What is the weather like in Paris today?"}]


@pytest.fixture(scope="module")
def smollm2_server(ray_session, smollm2_dir):
    config = load("colocated.yaml")
    config = config.model_copy(update={
        "model": config.model.model_copy(update={"path": "builtin:smollm2"}),
        "colocated": config.colocated.model_copy(update={"replicas": 1}),
        "ingress": config.ingress.model_copy(update={"chat_template": str(TEMPLATE), "tool_call_parser": "hermes"}),
    })
    with serving(config) as live:
        yield live


@pytest.fixture
def client(smollm2_server):
    return openai.OpenAI(base_url=smollm2_server[1] + "/v1", api_key="unused", max_retries=0, timeout=300)


def test_json_object(client):
    messages = [{"role": "user", "content": "Describe a cat as a JSON object with the keys name and age."}]
    out = client.chat.completions.create(model=SERVED, messages=messages, max_tokens=60, temperature=0,
                                         response_format={"type": "json_object"})
    assert out.choices[0].finish_reason == "stop"
    value = json.loads(out.choices[0].message.content)
    assert isinstance(value, dict) and value
    free = client.chat.completions.create(model=SERVED, messages=messages, max_tokens=60, temperature=0)
    assert free.choices[0].message.content != out.choices[0].message.content


@pytest.mark.parametrize("choice, name", [("required", None), ({"type": "function", "function": {"name": "get_time"}},
                                                                "get_time")])
def test_required_and_named_tool_choice_always_parse(client, choice, name):
    out = client.chat.completions.create(model=SERVED, messages=ASK, tools=[WEATHER, TIME], tool_choice=choice,
                                         max_tokens=80, temperature=0)
    choice0 = out.choices[0]
    assert choice0.finish_reason == "tool_calls" and choice0.message.content is None
    (call,) = choice0.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name in ({"get_weather", "get_time"} if name is None else {name})
    arguments = json.loads(call.function.arguments)
    assert isinstance(arguments["city"], str)
    streamed = list(client.chat.completions.create(model=SERVED, messages=ASK, tools=[WEATHER, TIME],
                                                   tool_choice=choice, max_tokens=80, temperature=0, stream=True))
    deltas = [d for c in streamed if c.choices for d in (c.choices[0].delta.tool_calls or [])]
    assert (deltas[0].index, deltas[0].id[:5], deltas[0].type, deltas[0].function.name) == \
        (0, "call_", "function", call.function.name)
    assert {d.index for d in deltas} == {0} and len(deltas) > 3  # the arguments as the grammar produces them
    assert "".join(d.function.arguments for d in deltas) == call.function.arguments
    assert streamed[0].choices[0].delta.role == "assistant"
    assert not "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
    assert [c.choices[0].finish_reason for c in streamed if c.choices][-1] == "tool_calls"
    with client.chat.completions.stream(model=SERVED, messages=ASK, tools=[WEATHER, TIME], tool_choice=choice,
                                        max_tokens=80, temperature=0) as events:
        final = events.get_final_completion().choices[0]
    (rebuilt,) = final.message.tool_calls
    assert (rebuilt.function.name, rebuilt.function.arguments, final.finish_reason) == \
        (call.function.name, call.function.arguments, "tool_calls")


def test_an_auto_answer_in_text_streams_as_it_is_decoded(client):
    """SmolLM2 answers this in text with the tools offered ("auto"): its content arrives in many chunks,
    the same text as the whole answer, not in one chunk at the end."""
    ask = dict(model=SERVED, messages=[{"role": "user", "content": "Write a short poem about the sea."}],
               tools=[WEATHER], max_tokens=40, temperature=0)
    out = client.chat.completions.create(**ask)
    assert out.choices[0].message.content and not out.choices[0].message.tool_calls
    pieces = [c.choices[0].delta.content for c in client.chat.completions.create(**ask, stream=True)
              if c.choices and c.choices[0].delta.content]
    assert "".join(pieces) == out.choices[0].message.content and len(pieces) > 10


def test_a_tool_result_continues_the_conversation(client):
    first = client.chat.completions.create(model=SERVED, messages=ASK, tools=[WEATHER], tool_choice="required",
                                           max_tokens=80, temperature=0)
    call = first.choices[0].message.tool_calls[0]
    messages = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 21, "sky": "sunny"})},
    ]
    answer = client.chat.completions.create(model=SERVED, messages=messages, tools=[WEATHER], max_tokens=40,
                                            temperature=0)
    message = answer.choices[0].message
    assert message.content or message.tool_calls  # "auto": an answer, or another well-formed call
    # The template wrote the first call's arguments as JSON once: a call that copies it has object arguments.
    assert all(isinstance(json.loads(c.function.arguments), dict) for c in message.tool_calls or [])
    assert answer.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_langchain_bind_tools(smollm2_server):
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(model=SERVED, base_url=smollm2_server[1] + "/v1", api_key="unused", temperature=0,
                     max_tokens=80, max_retries=0)
    bound = llm.bind_tools([WEATHER], tool_choice="get_weather")
    reply = bound.invoke("What is the weather like in Paris?")
    (call,) = reply.tool_calls
    assert call["name"] == "get_weather" and isinstance(call["args"]["city"], str)
    chunks = list(bound.stream("What is the weather like in Paris?"))
    assert len([c for c in chunks if c.tool_call_chunks]) > 3  # the call arrives in pieces
    summed = sum(chunks[1:], chunks[0])
    assert [(c["name"], c["args"]) for c in summed.tool_calls] == [(call["name"], call["args"])]
