"""OpenAI's Responses API (`POST /v1/responses`), for text: a request becomes a chat request (`input` as
the conversation, `instructions` as its system message, `text.format` as the structured output,
`max_output_tokens` as max_tokens) and its answer one output message, whole or streamed as the API's
events. Not served: tools, stored responses (`previous_response_id`, `store`), reasoning, background
runs; asking for them is a 400 naming the field."""

from __future__ import annotations

import time
import uuid
from typing import AsyncIterator

from fastapi import FastAPI, Request
from pydantic import BaseModel, ConfigDict, Field

from cluster.frontend.http.chat_request import prepare_chat
from cluster.frontend.http.fields import check_fields
from cluster.frontend.http.ingress import Ingress
from cluster.frontend.http.lifecycle import raise_if_failed, run_unless_disconnected
from cluster.frontend.http.openapi import ResponseObject, documented
from cluster.frontend.http.protocol import CLOSED_SCHEMA, ApiError, ChatCompletionRequest
from cluster.frontend.http.streaming import sse
from cluster.frontend.http.body_guard import tenant_of


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
    tools: list | None = None
    previous_response_id: str | None = None
    store: bool | None = None
    background: bool | None = None
    user: str | None = None


def _chat_request(req: ResponsesRequest) -> ChatCompletionRequest:
    for name in ("tools", "previous_response_id", "background", "store"):
        if getattr(req, name):
            raise ApiError(400, f"{name} is not supported on /v1/responses here; use /v1/chat/completions", name)
    messages = [{"role": "system", "content": req.instructions}] if req.instructions else []
    items = [{"role": "user", "content": req.input}] if isinstance(req.input, str) else req.input
    for item in items:
        if item.get("type", "message") != "message" or "role" not in item:
            raise ApiError(400, f"input items must be messages, got type {item.get('type')!r}", "input")
        content = item.get("content")
        if isinstance(content, list):  # [{"type": "input_text" | "output_text", "text": ...}]
            if any(not isinstance(p, dict) or p.get("type") not in ("input_text", "output_text", "text") for p in content):
                raise ApiError(400, "input message content must be text parts", "input")
            content = "".join(p.get("text", "") for p in content)
        messages.append({"role": item["role"], "content": content})
    fmt = (req.text or {}).get("format") or {"type": "text"}
    response_format = None
    if fmt.get("type") == "json_object":
        response_format = {"type": "json_object"}
    elif fmt.get("type") == "json_schema":
        response_format = {"type": "json_schema", "json_schema": {"name": fmt.get("name", "response"),
                                                                  "schema": fmt.get("schema"), "strict": fmt.get("strict")}}
    elif fmt.get("type") != "text":
        raise ApiError(400, f"text.format type {fmt.get('type')!r} is not text, json_object or json_schema", "text")
    try:
        return ChatCompletionRequest(model=req.model, messages=messages, max_tokens=req.max_output_tokens,
                                     temperature=req.temperature, top_p=req.top_p, seed=req.seed,
                                     response_format=response_format, user=req.user)
    except ValueError as exc:
        raise ApiError(400, f"input: {exc.errors()[0]['msg'] if hasattr(exc, 'errors') else exc}", "input") from None


def _response(rid: str, msg_id: str, model: str, text: str, status: str, usage: dict | None) -> dict:
    output = [_message(msg_id, text, "completed")] if status in ("completed", "incomplete") else []
    return {"id": rid, "object": "response", "created_at": int(time.time()), "status": status, "model": model,
            "output": output, "output_text": text, "error": None, "incomplete_details": None,
            "usage": usage, "parallel_tool_calls": False, "tool_choice": "none", "tools": []}


def _finished(rid: str, msg_id: str, model: str, result, usage: dict) -> dict:
    """The response of a finished answer: incomplete when max_output_tokens cut it."""
    status = "incomplete" if result.finish_reason == "length" else "completed"
    body = _response(rid, msg_id, model, result.text, status, usage)
    if status == "incomplete":
        body["incomplete_details"] = {"reason": "max_output_tokens"}
    return body


def _message(msg_id: str, text: str, status: str) -> dict:
    return {"type": "message", "id": msg_id, "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": []}]}


def add_responses_route(app: FastAPI, ingress: Ingress) -> None:
    @app.post("/v1/responses", response_model=None, responses=documented(ResponseObject, 400, 401, 404, 408, 413, 429,
                                                                         500, 503, 504, streams=True))
    async def create_response(req: ResponsesRequest, request: Request):
        arrival = time.perf_counter()
        tenant = tenant_of(request)
        check_fields(req, ingress.model.caps.accept_unknown_fields)
        chat = await prepare_chat(ingress, _chat_request(req))
        (stream,) = await ingress.open_all([chat.prompt], chat.params, tenant, user=req.user)
        rid, msg_id = f"resp_{uuid.uuid4().hex}", f"msg_{uuid.uuid4().hex}"

        def usage() -> dict:
            out = sum(len(r.token_ids) for r in stream.results)
            return {"input_tokens": len(chat.prompt), "output_tokens": out, "total_tokens": len(chat.prompt) + out,
                    "input_tokens_details": {"cached_tokens": stream.results[0].num_cached_tokens},
                    "output_tokens_details": {"reasoning_tokens": 0}}

        if req.stream:
            async def events() -> AsyncIterator[dict]:
                seq = iter(range(1 << 30))
                yield {"type": "response.created", "sequence_number": next(seq),
                       "response": _response(rid, msg_id, ingress.model.name, "", "in_progress", None)}
                yield {"type": "response.output_item.added", "sequence_number": next(seq), "output_index": 0,
                       "item": {**_message(msg_id, "", "in_progress"), "content": []}}
                yield {"type": "response.content_part.added", "sequence_number": next(seq), "item_id": msg_id,
                       "output_index": 0, "content_index": 0, "part": {"type": "output_text", "text": "", "annotations": []}}
                async for ev in ingress.events(stream, arrival):
                    if ev.text:
                        yield {"type": "response.output_text.delta", "sequence_number": next(seq), "item_id": msg_id,
                               "output_index": 0, "content_index": 0, "delta": ev.text, "logprobs": []}
                try:
                    raise_if_failed(stream.results[0], stream.own_deadline)
                except ApiError as exc:  # after the 200: the API's own failure event, not a cut stream
                    failed = _response(rid, msg_id, ingress.model.name, stream.results[0].text, "failed", usage())
                    failed["error"] = {"code": exc.kind, "message": exc.message}
                    yield {"type": "response.failed", "sequence_number": next(seq), "response": failed}
                    return
                text = stream.results[0].text
                yield {"type": "response.output_text.done", "sequence_number": next(seq), "item_id": msg_id,
                       "output_index": 0, "content_index": 0, "text": text, "logprobs": []}
                yield {"type": "response.content_part.done", "sequence_number": next(seq), "item_id": msg_id,
                       "output_index": 0, "content_index": 0, "part": {"type": "output_text", "text": text, "annotations": []}}
                yield {"type": "response.output_item.done", "sequence_number": next(seq), "output_index": 0,
                       "item": _message(msg_id, text, "completed")}
                final = _finished(rid, msg_id, ingress.model.name, stream.results[0], usage())
                yield {"type": f"response.{final['status']}", "sequence_number": next(seq), "response": final}
            return sse(events(), lambda: ingress.finish(stream, arrival))
        await run_unless_disconnected(request, ingress, [stream], arrival)
        result = stream.results[0]
        raise_if_failed(result, stream.own_deadline)
        return _finished(rid, msg_id, ingress.model.name, result, usage())
