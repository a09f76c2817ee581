"""Streamed tool calls: the call reader fed an answer token by token sends its content before the call
and the call as OpenAI deltas (the name first, then argument pieces), holds back only what could start a
call, and accumulates to what the whole answer parses to however it is cut; against the live tiny-model
server, a forced call streams its arguments as the grammar produces them and the SDK's accumulators
rebuild the non-streamed call."""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from actors.engine.text.tokenizer import DEFAULT_TOKENIZER_DIR
from cluster.frontend.http.tool_call_stream import CallStream
from cluster.frontend.http.tool_calls import CallReader
from tests.helpers.http_server import MODEL

ANSWER = ('I will check the weather for you.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
          '"unit": "celsius"}}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"city": "Paris"}}\n'
          '</tool_call>')
ANSWERS = [  # (parser, forced, answer)
    ("hermes", False, ANSWER),
    ("hermes", False, 'Plain text, no call: <tool_call>not json</tool_call> and a < sign\n'),
    ("hermes", False, '<tool_call>{"arguments": {"q": "a}\\"{"}, "name": "search"}</tool_call> Done.'),
    ("hermes", False, '<tool_call>{"name": "get_weather", "arguments": "{\\"city\\": \\"Lyon\\"}"}</tool_call>'),
    ("llama3_json", False, '{"name": "get_time", "parameters": {"city": "Rome"}}'),
    ("llama3_json", False, '{"answer": 42}'),
    (None, True, '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'),
    (None, True, '{"name": "get_weather", "argum'),  # cut short by max_tokens
]
ENUM_TOOL = {"type": "function", "function": {"name": "set_unit", "parameters": {
    "type": "object", "properties": {"unit": {"enum": ["celsius", "fahrenheit"]}, "digits": {"enum": [0, 1, 2]}},
    "required": ["unit", "digits"]}}}


def accumulate(deltas) -> tuple[str, list[tuple[str, str, str]]]:
    """Content and (id, name, arguments) per call, as OpenAI's clients add deltas up by index."""
    content, calls = "", {}
    for delta in deltas:
        content += delta.get("content") or ""
        for part in delta.get("tool_calls") or []:
            call = calls.setdefault(part["index"], {"id": None, "name": None, "arguments": ""})
            call["id"] = part.get("id") or call["id"]
            call["name"] = part.get("function", {}).get("name") or call["name"]
            call["arguments"] += part.get("function", {}).get("arguments") or ""
    return content, [(c["id"], c["name"], c["arguments"]) for _, c in sorted(calls.items())]


def whole(reader: CallReader, text: str) -> tuple[str | None, list[tuple[str, str]]]:
    content, calls = reader.parse(text)
    return content, [(c["function"]["name"], c["function"]["arguments"]) for c in calls]


def streamed(reader: CallReader, pieces: list[str]) -> tuple[str | None, list[tuple[str, str]], list[dict]]:
    stream = reader.stream()
    deltas = [stream.feed(p, last=i == len(pieces) - 1) for i, p in enumerate(pieces)]
    content, calls = accumulate(d for d in deltas if d)
    return (content or None) if calls else content, [(name, args) for _, name, args in calls], deltas


def test_a_hermes_answer_streams_its_content_then_its_calls_token_by_token():
    tokenizer = AutoTokenizer.from_pretrained(DEFAULT_TOKENIZER_DIR)
    ids = tokenizer.encode(ANSWER, add_special_tokens=False)
    pieces = [tokenizer.decode(ids[:i + 1])[len(tokenizer.decode(ids[:i])):] for i in range(len(ids))]
    assert "".join(pieces) == ANSWER
    content, calls, deltas = streamed(CallReader("hermes", False), pieces)
    assert content == "I will check the weather for you."
    assert calls == [("get_weather", '{"city": "Paris", "unit": "celsius"}'), ("get_time", '{"city": "Paris"}')]
    sent = [d for d in deltas if d]
    # All the content goes out before the first call's delta, which names it with empty arguments.
    first_call = next(i for i, d in enumerate(sent) if "tool_calls" in d)
    assert "".join(d.get("content", "") for d in sent[:first_call]) == content
    head = sent[first_call]["tool_calls"][0]
    assert (head["index"], head["type"], head["function"]["name"], head["id"][:5]) == (0, "function", "get_weather", "call_")
    # The arguments arrive piece by piece as they are decoded, not at the end.
    pieces_of = [p["function"]["arguments"] for d in sent for p in d.get("tool_calls", []) if p["index"] == 0]
    assert len([p for p in pieces_of if p]) > 3
    assert whole(CallReader("hermes", False), ANSWER) == (content, calls)


@pytest.mark.parametrize("parser, forced, text", ANSWERS)
def test_every_cut_of_an_answer_accumulates_to_the_whole_answer(parser, forced, text):
    reader = CallReader(parser, forced)
    expected = whole(reader, text)
    for cut in range(len(text) + 1):
        assert streamed(reader, [text[:cut], text[cut:]])[:2] == expected, cut
    assert streamed(reader, list(text))[:2] == expected


def test_answers_without_calls_are_their_text_and_cut_calls_keep_what_was_written():
    assert whole(CallReader("hermes", False), ANSWERS[1][2]) == (ANSWERS[1][2], [])
    assert whole(CallReader("llama3_json", False), '{"answer": 42}') == ('{"answer": 42}', [])
    assert whole(CallReader(None, True), '{"name": "get_weather", "argum') == (None, [("get_weather", "")])
    assert whole(CallReader("hermes", False), ANSWERS[3][2]) == (None, [("get_weather", '{"city": "Lyon"}')])


def test_only_what_could_start_a_call_is_held_back():
    stream = CallStream("hermes", False, False)
    assert stream.feed("The answer is <tool") == {"content": "The answer is"}
    assert stream.feed("box>\n") == {"content": " <toolbox>"}  # not a marker: given out; the newline waits
    assert stream.feed("") is None
    assert stream.feed("", last=True) == {"content": "\n"}  # no call was made: the text is the answer


def test_parallel_tool_calls_false_streams_the_first_call_only():
    content, calls, deltas = streamed(CallReader("hermes", False, one=True), list(ANSWER))
    assert calls == [("get_weather", '{"city": "Paris", "unit": "celsius"}')]
    assert {p["index"] for d in deltas if d for p in d.get("tool_calls", [])} == {0}


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "set_unit"}}])
def test_a_forced_call_streams_its_arguments_and_the_sdk_rebuilds_it(client, choice):
    ask = dict(model=MODEL, messages=[{"role": "user", "content": "Use celsius."}], tools=[ENUM_TOOL],
               tool_choice=choice, max_tokens=120, temperature=0)
    out = client.chat.completions.create(**ask)
    (call,) = out.choices[0].message.tool_calls
    assert out.choices[0].finish_reason == "tool_calls" and out.choices[0].message.content is None
    assert call.function.name == "set_unit" and set(json.loads(call.function.arguments)) == {"unit", "digits"}
    chunks = list(client.chat.completions.create(**ask, stream=True))
    deltas = [c.choices[0].delta.model_dump(exclude_none=True) for c in chunks if c.choices]
    content, calls = accumulate(deltas)
    assert content == "" and [(name, args) for _, name, args in calls] == [("set_unit", call.function.arguments)]
    assert len([d for d in deltas if d.get("tool_calls")]) > 2  # the name, then the arguments in pieces
    assert deltas[0]["role"] == "assistant" and chunks[-1].choices[0].finish_reason == "tool_calls"
    with client.chat.completions.stream(**ask) as events:
        final = events.get_final_completion()
    (rebuilt,) = final.choices[0].message.tool_calls
    assert (rebuilt.function.name, rebuilt.function.arguments, final.choices[0].finish_reason) == \
        ("set_unit", call.function.arguments, "tool_calls")


def test_a_forced_call_cut_by_max_tokens_is_the_same_streamed_and_whole(client):
    ask = dict(model=MODEL, messages=[{"role": "user", "content": "Use celsius."}], tools=[ENUM_TOOL],
               tool_choice="required", max_tokens=30, temperature=0)
    out = client.chat.completions.create(**ask)
    assert out.choices[0].finish_reason == "length"
    (cut,) = out.choices[0].message.tool_calls  # the tiny model's tokens are short: the arguments are cut
    assert (cut.function.name, cut.function.arguments) == ("set_unit", '{"unit')
    chunks = list(client.chat.completions.create(**ask, stream=True))
    content, calls = accumulate(c.choices[0].delta.model_dump(exclude_none=True) for c in chunks if c.choices)
    message = out.choices[0].message
    assert [(name, args) for _, name, args in calls] == \
        [(c.function.name, c.function.arguments) for c in message.tool_calls or []]
    assert (content or None) == message.content and chunks[-1].choices[0].finish_reason == "length"
