"""OpenAI's Responses API (`POST /v1/responses`), for text: a request becomes a chat request (`input` as
the conversation, `instructions` as its system message, `text.format` as the structured output,
`max_output_tokens` as max_tokens: responses_request.py, which decides every field and every key inside
the request) and its answer one output message, whole or streamed as the API's events. Not served:
tools, stored responses (`previous_response_id`, `store`), reasoning, background runs; asking for them
is a 400 naming the field."""

from __future__ import annotations

import time
import uuid
from typing import AsyncIterator

from fastapi import FastAPI, Request

from cluster.frontend.http.chat_request import prepare_chat
from cluster.frontend.http.ingress import Ingress
from cluster.frontend.http.lifecycle import raise_if_failed, run_unless_disconnected
from cluster.frontend.http.openapi import ResponseObject, documented
from cluster.frontend.http.protocol import ApiError
from cluster.frontend.http.responses_request import ResponsesRequest, as_chat, renamed
from cluster.frontend.http.streaming import sse
from cluster.frontend.http.body_guard import tenant_of


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
        try:  # the chat request's checks, its errors naming this request's fields
            chat = await prepare_chat(ingress, as_chat(req, ingress.model.caps.accept_unknown_fields))
            (stream,) = await ingress.open_all([chat.prompt], chat.params, tenant, user=req.user, arrival=arrival)
        except ApiError as exc:
            raise renamed(exc) from None
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
