"""A Responses API request (`POST /v1/responses`) and the chat request it becomes, with every field and
every key inside it decided as the chat route decides its fields (fields.py): honoured, refused by name
(400) unless it holds its neutral value, or unknown (400 naming it; logged with `ingress.unknown_fields:
accept`). A key sent as null asks for nothing.

Honoured: `input` (a string, or items: messages with `role` and `content` as a string or text parts,
joined by a newline as the chat route joins them; `function_call` items, the calls of an earlier answer,
which join the assistant message before them as chat's `tool_calls`; `function_call_output` items, a
call's result, which become chat's `tool` messages), `instructions` (the system message),
`max_output_tokens`, `temperature`, `top_p`, `seed`, `stream`, `text.format` (text, json_object,
json_schema with the keys chat's response_format takes: name, description, schema, strict), `user`,
`safety_identifier`, `metadata` (returned on the response), `service_tier`, `prompt_cache_key` (as chat
takes them: request_hints.py), `reasoning.effort` and `text.verbosity` (chat's reasoning_effort and
verbosity, for templates that read them),
function `tools` (`name`, `description`, `parameters`, `strict`) with `tool_choice` (none, auto,
required, or `{"type": "function", "name": ...}`) and `parallel_tool_calls`, as chat's. An output item of
an earlier response, given back as input (the SDK's `input += response.output`), carries `id` and
`status`, and its text parts `annotations` and `logprobs`: they describe that output and ask nothing of
this one, so they pass. `store` (unless false, as OpenAI's default) keeps the response, and
`previous_response_id` continues a stored one (its chain's items come before `input`; response_store.py).
Refused by name: what the API defines and this server does not do: hosted tools (web search, file search,
...), background runs, conversations, reasoning summaries, other item and part types, and the rest of
`REFUSED`.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from cluster.frontend.http import fields
from cluster.frontend.http.fields import check_fields
from cluster.frontend.http.protocol import CLOSED_SCHEMA, ApiError, ChatCompletionRequest


class ResponsesRequest(BaseModel):
    # undeclared fields: refused or logged (fields.py)
    model_config = ConfigDict(extra="allow", allow_inf_nan=False, json_schema_extra=CLOSED_SCHEMA)
    model: str
    input: str | list[dict] = Field(min_length=1)
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stream: bool = False
    text: dict | None = None  # {"format": {"type": "text" | "json_object" | "json_schema", ...}}
    tools: list[dict] | None = Field(None, max_length=128)
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool | None = None
    # who the request is for and how to admit and route it, as on chat (request_hints.py)
    metadata: dict[str, str] | None = None
    safety_identifier: str | None = Field(None, max_length=64)
    service_tier: Literal["auto", "default", "flex", "priority"] | None = None
    prompt_cache_key: str | None = Field(None, max_length=256)
    reasoning: dict | None = None  # {"effort": ...}: chat's reasoning_effort, for templates that read it
    include: list[str] | None = None  # extra output: INCLUDABLE
    top_logprobs: int | None = None  # with include message.output_text.logprobs: alternatives per token
    # declared for the API's schema, refused unless empty or false (`_NOT_HERE`)
    previous_response_id: str | None = None
    store: bool | None = None
    background: bool | None = None
    user: str | None = None


# Declared fields this server does not serve on this route: a 400 unless empty, false or null.
_NOT_HERE = ("background",)

# Undeclared fields of OpenAI's Responses API this server does not honour -> their neutral values.
REFUSED: dict[str, tuple] = {
    "truncation": ("disabled",), "conversation": (), "prompt": (),
    "max_tool_calls": (),
    "stream_options": ({}, {"include_obfuscation": False}),  # the stream is never obfuscated
    "prompt_cache_retention": (),
}

# The keys of the objects inside a request: each honoured (None), or refused unless one of its neutral
# values (a tuple). Any other key is unknown.
ITEM_KEYS: dict[str, tuple | None] = {"type": None, "role": None, "content": None, "id": None, "status": None,
                                      "phase": ()}
CALL_KEYS: dict[str, tuple | None] = {"type": None, "call_id": None, "name": None, "arguments": None, "id": None,
                                      "status": None}
CALL_OUTPUT_KEYS: dict[str, tuple | None] = {"type": None, "call_id": None, "output": None, "id": None, "status": None}
TOOL_KEYS: dict[str, tuple | None] = {"type": None, "name": None, "description": None, "parameters": None,
                                      "strict": None}
PART_KEYS: dict[str, tuple | None] = {"type": None, "text": None, "annotations": None, "logprobs": None,
                                      "prompt_cache_breakpoint": ()}
TEXT_KEYS: dict[str, tuple | None] = {"format": None, "verbosity": None}
REASONING_KEYS: dict[str, tuple | None] = {"effort": None, "summary": (), "generate_summary": ()}
FORMAT_KEYS: dict[str, dict[str, tuple | None]] = {  # by the format's type
    "text": {"type": None},
    "json_object": {"type": None},
    "json_schema": {"type": None, "name": None, "schema": None, "strict": None, "description": None},
}
ROLES = ("user", "assistant", "system", "developer")
ITEM_STATUSES = ("in_progress", "completed", "incomplete")
TEXT_PARTS = ("input_text", "output_text", "text")  # "text": chat's spelling, accepted here too
# A chat parameter named in an error -> the Responses field that set it.
_CHAT_NAMES = {"max_tokens": "max_output_tokens", "messages": "input", "response_format": "text.format",
               "reasoning_effort": "reasoning.effort", "verbosity": "text.verbosity"}


def input_items(req: ResponsesRequest) -> list[dict]:
    """The request's input as items (a string is one user message)."""
    return [{"role": "user", "content": req.input}] if isinstance(req.input, str) else req.input


def as_chat(req: ResponsesRequest, accept_unknown: bool, previous: tuple[dict, ...] = ()) -> ChatCompletionRequest:
    """The chat request `req` asks for, after the `previous` items of its stored chain (previous_response_id);
    a 400 naming the first field or key refused, or every unknown one (unless `accept_unknown`: then they
    are logged)."""
    for name in _NOT_HERE:
        if getattr(req, name):
            raise ApiError(400, f"{name} is not supported on /v1/responses here; use /v1/chat/completions", name)
    unknown: list[str] = []
    messages = [{"role": "system", "content": req.instructions}] if req.instructions else []
    for i, item in enumerate(previous):
        _add_item(messages, item, f"previous_response_id's item {i}", unknown)
    for i, item in enumerate(input_items(req)):
        _add_item(messages, item, f"input[{i}]", unknown)
    response_format = _response_format(req.text, unknown)
    tools = [_chat_tool(tool, f"tools[{i}]", unknown) for i, tool in enumerate(req.tools or ())] or None
    tool_choice = _chat_tool_choice(req.tool_choice)
    logprobs = _logprobs_included(req)
    effort = _choice(req.reasoning, "reasoning", REASONING_KEYS, "effort", EFFORTS, unknown)
    verbosity = _choice(req.text, "text", TEXT_KEYS, "verbosity", VERBOSITIES, unknown)
    check_fields(req, accept_unknown, REFUSED, unknown)
    try:
        return ChatCompletionRequest(model=req.model, messages=messages, max_tokens=req.max_output_tokens,
                                     temperature=req.temperature, top_p=req.top_p, seed=req.seed,
                                     response_format=response_format, user=req.user, tools=tools,
                                     tool_choice=tool_choice, parallel_tool_calls=req.parallel_tool_calls,
                                     reasoning_effort=effort, verbosity=verbosity, logprobs=logprobs,
                                     top_logprobs=req.top_logprobs if logprobs else None)
    except ValueError as exc:
        raise ApiError(400, f"input: {exc.errors()[0]['msg'] if hasattr(exc, 'errors') else exc}", "input") from None


def renamed(exc: ApiError) -> ApiError:
    """A chat request's error as the Responses request's: its parameter named as this API names it."""
    name = _CHAT_NAMES.get(exc.param or "")
    if name is None:
        return exc
    return ApiError(exc.status, exc.message.replace(exc.param, name), name, exc.kind, exc.headers)


def _add_item(messages: list[dict], item, where: str, unknown: list[str]) -> None:
    """`item` appended to the chat conversation `messages`: a function call joins the assistant message just
    before it (chat carries an answer's calls in its message), a call's output is a tool message."""
    if not isinstance(item, dict):
        raise ApiError(400, f"{where} must be an input item object", where)
    kind = item.get("type") or "message"
    if kind == "message":
        messages.append(_message(item, where, unknown))
    elif kind == "function_call":
        _check_keys(item, where, CALL_KEYS, unknown)
        _check_given_back(item, where)
        for key in ("call_id", "name", "arguments"):
            if not isinstance(item.get(key), str):
                raise ApiError(400, f"{where}.{key} must be a string", f"{where}.{key}")
        call = {"id": item["call_id"], "type": "function",
                "function": {"name": item["name"], "arguments": item["arguments"]}}
        last = messages[-1] if messages else None
        if last is not None and last["role"] == "assistant":
            last["tool_calls"] = [*(last.get("tool_calls") or ()), call]
        else:
            messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
    elif kind == "function_call_output":
        _check_keys(item, where, CALL_OUTPUT_KEYS, unknown)
        _check_given_back(item, where)
        if not isinstance(item.get("call_id"), str):
            raise ApiError(400, f"{where}.call_id must be a string", f"{where}.call_id")
        output = item.get("output")
        if isinstance(output, list):
            output = "\n".join(_text_part(part, f"{where}.output[{j}]", unknown)["text"] for j, part in enumerate(output))
        if not isinstance(output, str):
            raise ApiError(400, f"{where}.output must be a string or a list of text parts", f"{where}.output")
        messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": output})
    else:
        raise ApiError(400, f"{where}.type: only message, function_call and function_call_output items are "
                       f"served here, not {kind!r}", f"{where}.type")


def _chat_tool(tool, where: str, unknown: list[str]) -> dict:
    """A Responses function tool (flat: name, parameters, ...) as chat's (`{"type", "function": {...}}`)."""
    if not isinstance(tool, dict):
        raise ApiError(400, f"{where} must be a tool object", where)
    if tool.get("type") != "function":
        raise ApiError(400, f"{where}.type: only function tools are served here, not {tool.get('type')!r}",
                       f"{where}.type")
    _check_keys(tool, where, TOOL_KEYS, unknown)
    if not isinstance(tool.get("name"), str) or not tool["name"]:
        raise ApiError(400, f"{where}.name must be a non-empty string", f"{where}.name")
    if tool.get("parameters") is not None and not isinstance(tool["parameters"], dict):
        raise ApiError(400, f"{where}.parameters must be a JSON schema object", f"{where}.parameters")
    for key, kind, said in (("description", str, "a string"), ("strict", bool, "true or false")):
        if tool.get(key) is not None and not isinstance(tool[key], kind):
            raise ApiError(400, f"{where}.{key} must be {said}", f"{where}.{key}")
    function = {key: tool[key] for key in ("name", "description", "parameters", "strict") if tool.get(key) is not None}
    return {"type": "function", "function": function}


INCLUDABLE = ("message.output_text.logprobs",)  # `include` items served: the output text's token logprobs
EFFORTS = ("minimal", "low", "medium", "high")
VERBOSITIES = ("low", "medium", "high")


def _logprobs_included(req: ResponsesRequest) -> bool:
    """Whether the output text carries its tokens' logprobs (`include`), checked against what asks for them."""
    for i, item in enumerate(req.include or ()):
        if item not in INCLUDABLE:
            raise ApiError(400, f"include[{i}]: {item!r} is not served here (only {', '.join(INCLUDABLE)})",
                           f"include[{i}]")
    wanted = "message.output_text.logprobs" in (req.include or ())
    if req.top_logprobs and not wanted:
        raise ApiError(400, "top_logprobs needs include: [\"message.output_text.logprobs\"]", "top_logprobs")
    if wanted and req.tools:
        raise ApiError(400, "include message.output_text.logprobs is not served with tools here", "include")
    return wanted


def _choice(obj: dict | None, where: str, keys: dict, key: str, allowed: tuple, unknown: list[str]) -> str | None:
    """`obj[key]`, one of `allowed` (the object's other keys checked against `keys`)."""
    if obj is None:
        return None
    if where == "reasoning":  # `text` has its keys checked with its format
        _check_keys(obj, where, keys, unknown)
    value = obj.get(key)
    if value is not None and value not in allowed:
        raise ApiError(400, f"{where}.{key} must be one of {', '.join(allowed)}", f"{where}.{key}")
    return value


def _chat_tool_choice(choice):
    """`tool_choice` as chat takes it: a named function is `{"type": "function", "name": ...}` here."""
    if choice is None or choice in ("none", "auto", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str) \
            and set(choice) <= {"type", "name"}:
        return {"type": "function", "function": {"name": choice["name"]}}
    raise ApiError(400, 'tool_choice must be "none", "auto", "required" or {"type": "function", "name": ...}',
                   "tool_choice")


def _message(item: dict, where: str, unknown: list[str]) -> dict:
    _check_keys(item, where, ITEM_KEYS, unknown)
    role, content = item.get("role"), item.get("content")
    if role not in ROLES:
        raise ApiError(400, f"{where}.role must be one of {', '.join(ROLES)}, not {role!r}", f"{where}.role")
    _check_given_back(item, where)
    if isinstance(content, list):
        content = [_text_part(part, f"{where}.content[{j}]", unknown) for j, part in enumerate(content)]
    elif not isinstance(content, str):
        raise ApiError(400, f"{where}.content must be a string or a list of text parts", f"{where}.content")
    return {"role": role, "content": content}


def _check_given_back(item: dict, where: str) -> None:
    """`id` and `status`: an earlier output item given back describes itself with them."""
    if item.get("status") not in (None, *ITEM_STATUSES):
        raise ApiError(400, f"{where}.status must be one of {', '.join(ITEM_STATUSES)}", f"{where}.status")
    if item.get("id") is not None and not isinstance(item["id"], str):
        raise ApiError(400, f"{where}.id must be a string", f"{where}.id")


def _text_part(part, where: str, unknown: list[str]) -> dict:
    if not isinstance(part, dict):
        raise ApiError(400, f"{where} must be a content part object", where)
    _check_keys(part, where, PART_KEYS, unknown)
    if part.get("type") not in TEXT_PARTS:
        raise ApiError(400, f"{where}.type: only text parts ({', '.join(TEXT_PARTS[:2])}) are served, not "
                       f"{part.get('type')!r}", f"{where}.type")
    if not isinstance(part.get("text"), str):
        raise ApiError(400, f"{where}.text must be a string", f"{where}.text")
    for key in ("annotations", "logprobs"):
        if part.get(key) is not None and not isinstance(part[key], list):
            raise ApiError(400, f"{where}.{key} must be a list", f"{where}.{key}")
    return {"type": "text", "text": part["text"]}


def _response_format(text: dict | None, unknown: list[str]) -> dict | None:
    """Chat's response_format for `text` (None: plain text)."""
    if text is None:
        return None
    _check_keys(text, "text", TEXT_KEYS, unknown)
    fmt = text.get("format")
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind not in FORMAT_KEYS:
        raise ApiError(400, f"text.format.type must be one of {', '.join(FORMAT_KEYS)}, not {kind!r}",
                       "text.format.type")
    _check_keys(fmt, "text.format", FORMAT_KEYS[kind], unknown)
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        for key, kinds in _JSON_SCHEMA_TYPES.items():
            if (fmt.get(key) is not None or key == "schema") and not isinstance(fmt.get(key), kinds):
                raise ApiError(400, f"text.format.{key} must be {_JSON_SCHEMA_TYPES_SAID[key]}", f"text.format.{key}")
        return {"type": "json_schema", "json_schema": {key: fmt[key] for key in _JSON_SCHEMA_TYPES
                                                       if fmt.get(key) is not None}}
    return None


# A json_schema format's keys, as chat's response_format.json_schema takes them (the schema is required).
_JSON_SCHEMA_TYPES = {"name": str, "description": str, "schema": dict, "strict": bool}
_JSON_SCHEMA_TYPES_SAID = {"name": "a string", "description": "a string", "schema": "a JSON schema object",
                           "strict": "true or false"}


def _check_keys(obj: dict, where: str, keys: dict[str, tuple | None], unknown: list[str]) -> None:
    """A 400 for a key of `obj` refused here (not one of its neutral values); unknown keys are added to
    `unknown` (as `where.key`)."""
    for key, value in obj.items():
        if value is None or (key in keys and keys[key] is None):
            continue
        if key not in keys:
            unknown.append(f"{where}.{key}")
        elif value not in keys[key]:
            neutral = f" (only {fields.neutral(keys[key])} is accepted)" if keys[key] else ""
            raise ApiError(400, f"{where}.{key} is not supported by this server{neutral}", f"{where}.{key}")
