"""Tool calling in chat completions: the request's `tools` go to the chat template, the model's answer is
parsed back into OpenAI `tool_calls`.

- `tool_choice` "none": the tools are not offered; "auto" (the default with tools): the model answers as
  it likes and the configured parser (`ingress.tool_call_parser`) finds its calls, so "auto" without a
  parser is a 400, as in vLLM; "required" or a named function: a grammar (a JSON schema over the tools'
  names and parameters) makes the answer exactly one call, `{"name": ..., "arguments": {...}}`, which
  always parses.
- Parsers: `hermes` (Qwen, Hermes, the shipped chatml-tools template): `<tool_call>{json}</tool_call>`
  blocks, the text around them is the content; `llama3_json`: an answer that is a JSON object
  `{"name": ..., "parameters": {...}}`. Both read an answer as it is decoded (`tool_call_stream.py`), so
  a streamed answer sends its content and calls as they come, and a whole answer is the same read at once.
- Messages: an assistant message's `tool_calls` reach the template with their arguments as objects (the
  templates render them as JSON, once), a `tool` message as it is.
- `parallel_tool_calls: false`: only an answer's first call is made (a forced answer is one call anyway).
- A call cut short by max_tokens is made with the arguments written so far (as OpenAI's), finish reason
  "length"; a forced answer cut before its name is text.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from actors.protocol.structured_output import StructuredOutput
from cluster.frontend.http.protocol import ApiError
from cluster.frontend.http.tool_call_stream import CallStream

PARSERS = ("hermes", "llama3_json")


def plan(req, parser: str | None) -> tuple[list[dict] | None, StructuredOutput | None]:
    """(the tools to offer the template, the grammar the answer must follow) for a chat request."""
    if not req.tools:
        if req.tool_choice not in (None, "none"):
            raise ApiError(400, "tool_choice needs tools", "tool_choice")
        return None, None
    choice = req.tool_choice or "auto"
    tools = [t.model_dump(exclude_none=True) for t in req.tools]
    if choice == "none":
        return None, None
    if choice == "auto":
        if parser is None:
            raise ApiError(400, 'tool_choice "auto" needs a tool-call parser: set ingress.tool_call_parser '
                                f"({' or '.join(PARSERS)})", "tool_choice")
        return tools, None
    functions = [t.function for t in req.tools]
    if choice != "required":
        name = choice.get("function", {}).get("name") if isinstance(choice, dict) else None
        functions = [f for f in functions if f.name == name]
        if not functions:
            raise ApiError(400, f"tool_choice names {name!r}, which is not among the tools", "tool_choice")
    calls = [{"type": "object", "properties": {"name": {"const": f.name},
                                               "arguments": f.parameters or {"type": "object"}},
              "required": ["name", "arguments"], "additionalProperties": False} for f in functions]
    schema = calls[0] if len(calls) == 1 else {"anyOf": calls}
    return tools, StructuredOutput("json_schema", json.dumps(schema))


def template_messages(messages: list[dict]) -> list[dict]:
    """The conversation as chat templates expect it: tool call arguments as objects, not JSON text."""
    out = []
    for m in messages:
        if m.get("tool_calls"):
            calls = []
            for call in m["tool_calls"]:
                function = dict(call.get("function") or {})
                if isinstance(function.get("arguments"), str):
                    try:
                        function["arguments"] = json.loads(function["arguments"])
                    except json.JSONDecodeError:
                        raise ApiError(400, "messages: a tool call's arguments are not JSON", "messages") from None
                calls.append({**call, "function": function})
            m = {**m, "tool_calls": calls}
        out.append({k: v for k, v in m.items() if v is not None})
    return out


@dataclass(frozen=True)
class CallReader:
    """How a request's answers are read for calls: the configured parser, or `forced` (the grammar made
    the answer one JSON call); `one`: parallel_tool_calls false."""
    parser: str | None
    forced: bool
    one: bool = False

    def stream(self) -> CallStream:
        return CallStream(self.parser, self.forced, self.one)

    def parse(self, text: str) -> tuple[str | None, list[dict]]:
        """(content, tool_calls) of a whole answer: what its stream sends, accumulated. Content is None
        beside calls when there is none."""
        reader = self.stream()
        content = (reader.feed(text, last=True) or {}).get("content", "")
        calls = [{"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
                 for c in reader.calls[:1 if self.one else None]]
        return (content or None) if calls else content, calls


def parse(text: str, parser: str | None, forced: bool, one: bool = False) -> tuple[str | None, list[dict]]:
    return CallReader(parser, forced, one).parse(text)
