"""OpenAI's Responses API (`POST /v1/responses`), for text: a request becomes a chat request (`input` as
the conversation, `instructions` as its system message, `text.format` as the structured output,
`max_output_tokens` as max_tokens: responses_request.py, which decides every field and every key inside
the request) and its answer output items (a message, function calls: responses_output.py), whole or
streamed as the API's events. `store` and `previous_response_id` keep and continue responses in the
ingress's memory (response_store.py), read back by `GET /v1/responses/{id}`. Not served: hosted tools,
reasoning summaries, background runs; asking for them is a 400 naming the field.

A streamed answer cut by `max_output_tokens` ends with `response.incomplete`, as OpenAI's API ends it
(vLLM sends `response.completed`); the openai SDK's `responses.stream().get_final_response()` and the
Agents SDK then raise, as they do against OpenAI: give such clients room to finish."""

from __future__ import annotations

import time
import uuid
from typing import AsyncIterator

from fastapi import FastAPI, Request

from cluster.frontend.http.chat_request import prepare_chat
from cluster.frontend.http import responses
from cluster.frontend.http.ingress import Ingress
from cluster.frontend.http.lifecycle import raise_if_failed, run_unless_disconnected
from cluster.frontend.http.openapi import DeletedResponse, ResponseObject, documented
from cluster.frontend.http.protocol import ApiError
from cluster.frontend.http.request_hints import hints_of
from cluster.frontend.http.responses_output import ResponseOutput
from cluster.frontend.http.responses_request import ResponsesRequest, as_chat, input_items, renamed
from cluster.frontend.http.tool_calls import CallReader
from cluster.frontend.http.streaming import sse
from cluster.frontend.http.body_guard import tenant_of


def _response(rid: str, req: ResponsesRequest, model: str, status: str, output: list[dict],
              usage: dict | None) -> dict:
    text = "".join(part["text"] for item in output if item["type"] == "message" for part in item["content"])
    return {"id": rid, "object": "response", "created_at": int(time.time()), "status": status, "model": model,
            "output": output, "output_text": text, "error": None, "incomplete_details": None, "usage": usage,
            "parallel_tool_calls": req.parallel_tool_calls is not False, "tool_choice": req.tool_choice or
            ("auto" if req.tools else "none"), "tools": req.tools or [], "metadata": req.metadata or {},
            "service_tier": "default" if req.service_tier in (None, "auto") else req.service_tier,
            "safety_identifier": req.safety_identifier, "prompt_cache_key": req.prompt_cache_key, "user": req.user,
            "previous_response_id": req.previous_response_id, "store": req.store is not False}


def _finished(rid: str, req: ResponsesRequest, model: str, result, output: ResponseOutput, usage: dict) -> dict:
    """The response of a finished answer: incomplete when max_output_tokens cut it."""
    status = "incomplete" if result.finish_reason == "length" else "completed"
    body = _response(rid, req, model, status, output.items, usage)
    if status == "incomplete":
        body["incomplete_details"] = {"reason": "max_output_tokens"}
    return body


def _deltas(calls: CallReader | None):
    """How an answer's text becomes chat deltas: through a call reader when tools were offered."""
    if calls is None:
        return lambda text, last: {"content": text}
    return calls.stream().feed


def add_responses_route(app: FastAPI, ingress: Ingress) -> None:
    @app.post("/v1/responses", response_model=None, responses=documented(ResponseObject, 400, 401, 404, 408, 413, 429,
                                                                         500, 503, 504, streams=True))
    async def create_response(req: ResponsesRequest, request: Request):
        """OpenAI's Responses API as the OpenAI Agents SDK uses it: text and function-call items, function tools,
        `previous_response_id`; every field honoured or a 400 naming it (fields.md)."""
        arrival = time.perf_counter()
        tenant = tenant_of(request)
        previous = ()
        if req.previous_response_id is not None:
            stored = ingress.stored.get(tenant, req.previous_response_id)
            if stored is None or stored.body.get("object") != "response":
                raise ApiError(400, f"previous_response_id: no stored response {req.previous_response_id!r} (kept "
                               "in the ingress's memory, per tenant, up to ingress.stored_responses; a restart "
                               "forgets them)", "previous_response_id")
            previous = stored.conversation
        try:  # the chat request's checks, its errors naming this request's fields
            chat = await prepare_chat(ingress, as_chat(req, ingress.model.caps.accept_unknown_fields, previous))
            (stream,) = await ingress.open_all([chat.prompt], chat.params, tenant, hints=hints_of(req), arrival=arrival)
        except ApiError as exc:
            raise renamed(exc) from None
        rid = f"resp_{uuid.uuid4().hex}"
        model = ingress.model.name

        def usage() -> dict:
            out = sum(len(r.token_ids) for r in stream.results)
            return {"input_tokens": len(chat.prompt), "output_tokens": out, "total_tokens": len(chat.prompt) + out,
                    "input_tokens_details": {"cached_tokens": stream.results[0].num_cached_tokens},
                    "output_tokens_details": {"reasoning_tokens": 0}}

        output, delta_of = ResponseOutput(chat.calls is None, chat.params.logprobs is not None), _deltas(chat.calls)

        def logprobs(entries) -> list[dict] | None:
            return responses.chat_logprobs(ingress.model.tokenizer, entries)["content"] if entries else None

        def finished(result) -> dict:
            body = _finished(rid, req, model, result, output, usage())
            if req.store is not False:
                ingress.stored.put(tenant, body, [*previous, *input_items(req), *body["output"]])
            return body
        if req.stream:
            async def events() -> AsyncIterator[dict]:
                seq = iter(range(1 << 30))
                yield {"type": "response.created", "sequence_number": next(seq),
                       "response": _response(rid, req, model, "in_progress", [], None)}
                for event in output.start():
                    yield {**event, "sequence_number": next(seq)}
                async for ev in ingress.events(stream, arrival):
                    delta = delta_of(ev.text, ev.finished) if ev.text or ev.finished else None
                    for event in output.feed(delta, logprobs(ev.logprobs)):
                        yield {**event, "sequence_number": next(seq)}
                try:
                    raise_if_failed(stream.results[0], stream.own_deadline)
                except ApiError as exc:  # after the 200: the API's own failure event, not a cut stream
                    failed = _response(rid, req, model, "failed", output.items, usage())
                    failed["error"] = {"code": exc.kind, "message": exc.message}
                    yield {"type": "response.failed", "sequence_number": next(seq), "response": failed}
                    return
                for event in output.finish():
                    yield {**event, "sequence_number": next(seq)}
                final = finished(stream.results[0])
                yield {"type": f"response.{final['status']}", "sequence_number": next(seq), "response": final}
            return sse(events(), lambda: ingress.finish(stream, arrival))
        await run_unless_disconnected(request, ingress, [stream], arrival)
        result = stream.results[0]
        raise_if_failed(result, stream.own_deadline)
        output.start()
        output.feed(delta_of(result.text, True), logprobs(result.logprobs))
        output.finish()
        return finished(result)

    @app.get("/v1/responses/{response_id}", response_model=None, responses=documented(ResponseObject, 401, 404))
    async def get_response(response_id: str, request: Request):
        """A stored response (kept unless `store: false`), from the ingress's memory, per tenant."""
        stored = ingress.stored.get(tenant_of(request), response_id)
        if stored is None or stored.body.get("object") != "response":
            raise ApiError(404, f"no stored response {response_id!r}", "response_id", "not_found_error")
        return stored.body

    @app.delete("/v1/responses/{response_id}", response_model=None, responses=documented(DeletedResponse, 401, 404))
    async def delete_response(response_id: str, request: Request):
        """Forgets a stored response."""
        if not ingress.stored.drop(tenant_of(request), response_id):
            raise ApiError(404, f"no stored response {response_id!r}", "response_id", "not_found_error")
        return {"id": response_id, "object": "response", "deleted": True}
