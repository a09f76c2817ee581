"""Tool calling in chat completions: the request's `tools` go to the chat template, the model's answer is
parsed back into OpenAI `tool_calls`.

- `tool_choice` "none": the tools are not offered; "auto" (the default with tools): the model answers as
  it likes and the configured parser (`ingress.model.tool_call_parser`) finds its calls, so "auto" without a
  parser is a 400, as in vLLM; "required" or a named function: a grammar (a JSON schema over the tools'
  names and parameters) makes the answer exactly one call, `{"name": ..., "arguments": {...}}`, which
  always parses.
- Parsers: `hermes` (Qwen, Hermes, the shipped chatml-tools template): `<tool_call>{json}</tool_call>`
  blocks, the text around them is the content; `llama3_json`: the whole answer is one JSON object
  `{"name": ..., "parameters": {...}}`.
- Messages: an assistant message's `tool_calls` reach the template with their arguments as objects (the
  templates render them as JSON, once), a `tool` message as it is.
- `parallel_tool_calls: false`: only an answer's first call is made (a forced answer is one call anyway).
"""

from __future__ import annotations

import json
import re
import uuid

from actors.protocol.structured_output import StructuredOutput
from cluster.frontend.http.protocol import ApiError

PARSERS = ("hermes", "llama3_json")
_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


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
            raise ApiError(400, 'tool_choice "auto" needs a tool-call parser: set ingress.model.tool_call_parser '
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


def parse(text: str, parser: str | None, forced: bool, one: bool = False) -> tuple[str | None, list[dict]]:
    """(content, tool_calls) of an answer. `forced`: the grammar made it one JSON call, unless max_tokens
    cut it short: then there is no call, and the text is the answer (its finish reason says "length").
    `one` (parallel_tool_calls: false): only the answer's first call is made."""
    if forced:
        call = _json_object(text)
        if call is None:
            return text, []
        return None, [_call(call["name"], call["arguments"])]
    if parser == "hermes":
        calls = []
        for block in _HERMES.findall(text):
            call = _json_object(block)
            if call is not None and isinstance(call.get("name"), str):
                calls.append(_call(call["name"], call.get("arguments", {})))
        if calls:
            content = _HERMES.sub("", text).strip()
            return content or None, calls[:1] if one else calls
    if parser == "llama3_json":
        call = _json_object(text.strip())
        if call is not None and isinstance(call.get("name"), str):
            return None, [_call(call["name"], call.get("parameters", call.get("arguments", {})))]
    return text, []


def _json_object(text: str) -> dict | None:
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return None
    return value if isinstance(value, dict) else None


def _call(name: str, arguments) -> dict:
    # A model that copies a history of string arguments writes its own as a string holding JSON: that
    # string is already the wire form (encoding it again would hand the client a str, not an object).
    if isinstance(arguments, str) and isinstance(_json_object(arguments), dict):
        text = arguments
    else:
        text = json.dumps(arguments, ensure_ascii=False)
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function", "function": {"name": name, "arguments": text}}
