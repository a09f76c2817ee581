"""The OpenAI-compatible HTTP server in front of the cluster (FastAPI): routes, error envelopes, probes.

Each HTTP request becomes one cluster request per prompt (`ingress.py`). A client that disconnects
cancels its response (streamed or not), and the request is aborted in the cluster.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from cluster.control.config import IngressSection
from cluster.control.lifecycle.kv_tiers import tier_stats
from cluster.control.scheduler.scheduler_state import SchedulerState
from cluster.frontend.http import responses
from cluster.frontend.http.body_guard import AdminCheck, BodyGuard, tenant_of
from cluster.frontend.http.chat_request import prepare_chat
from cluster.frontend.http.ingress import Ingress
from cluster.frontend.http.lifecycle import ClientGone, raise_if_failed, run_unless_disconnected
from cluster.frontend.http.openapi import (
    ChatCompletionResponse, CompletionResponse, HealthBody, ModelCard, ModelList, ReadyBody, documented,
    without_validation_answers,
)
from cluster.frontend.http.protocol import ApiError, ChatCompletionRequest, CompletionRequest
from cluster.frontend.http.request_hints import hints_of
from cluster.frontend.http.responses_api import add_responses_route
from cluster.frontend.http.streaming import chat_chunks, completion_chunks, sse
from cluster.frontend.http.trace_middleware import TraceMiddleware
from cluster.frontend.http.token_routes import add_token_routes
from kv_transfer.curve import rejected_handshakes

log = logging.getLogger("tandem.ingress")
_STATE_TIMEOUT_S = 5.0


def _serves(state: SchedulerState) -> bool:
    roles = {v.role for v in state.workers.values()}
    return roles >= {"prefill", "decode"} or "colocated" in roles


def create_app(ingress: Ingress, scheduler, admin: AdminCheck | None = None,
               body_timeout_s: float = IngressSection().body_timeout_s) -> FastAPI:
    """`scheduler`: the scheduler actor, or the list of its shards; `admin`: who may call `/admin/*`
    (admin.AdminAccess.check; None: nobody), checked with the API key, before any body."""
    app = FastAPI(title="tandem", version="0.1.0")

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError):
        _log_refusal(request, exc.status, exc.message)
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):  # FastAPI's own: 404, 405, unparsable bodies
        _log_refusal(request, exc.status_code, str(exc.detail))
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return JSONResponse(ApiError(exc.status_code, str(exc.detail), None, kind).body(), status_code=exc.status_code,
                            headers=getattr(exc, "headers", None))

    @app.exception_handler(ClientGone)
    async def _client_gone(_: Request, __: ClientGone):
        return Response(status_code=499)  # nobody reads it; nginx's "client closed request"

    @app.exception_handler(Exception)
    async def _internal(_: Request, exc: Exception):  # a bug: logged, answered in the envelope
        log.exception("unhandled error in a request: %s", type(exc).__name__)
        return JSONResponse(ApiError(500, f"internal error ({type(exc).__name__})", None, "server_error").body(),
                            status_code=500)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {}
        if first.get("type") == "json_invalid":  # its loc is a byte offset, not a field
            error = ApiError(400, f"the request body is not valid JSON ({first.get('ctx', {}).get('error', '')})")
        else:
            loc = [str(p) for p in first.get("loc", ()) if p != "body"]
            error = ApiError(400, f"{'.'.join(loc) or 'body'}: {first.get('msg', 'invalid request')}",
                             loc[0] if loc else None)
        _log_refusal(request, 400, error.message)
        return JSONResponse(error.body(), status_code=400)

    # API key first, then the body's bytes as they arrive, on every route: nobody gets a body read for free.
    app.add_middleware(BodyGuard, gate=ingress.gate, max_body_bytes=ingress.max_body_bytes, admin=admin,
                       body_timeout_s=body_timeout_s)
    if ingress.spans.tracer is not None:  # outside the guard: a refused request has its span too
        app.add_middleware(TraceMiddleware, tracer=ingress.spans.tracer)

    @app.get("/health", response_model=None, responses={
        200: {"model": HealthBody, "description": "the ingress serves"},
        503: {"model": HealthBody, "description": "its token sink's receiving thread is dead: restart the ingress"}})
    async def health():
        """Liveness of the ingress itself (no call to the scheduler): a probe that restarts a broken one."""
        # A dead token-sink thread would leave every stream empty while the server looked fine: the
        # liveness probe must fail so the pod (or the operator) restarts the ingress.
        if not ingress.client.sink_alive:
            return JSONResponse({"status": "unhealthy", "reason": "the token sink's receiving thread is dead"},
                                status_code=503)
        return {"status": "ok"}

    shards = list(scheduler) if isinstance(scheduler, (list, tuple)) else [scheduler]

    async def shard_states() -> list[SchedulerState]:
        try:
            return await asyncio.wait_for(asyncio.gather(*(_ref(s.state.remote()) for s in shards)), _STATE_TIMEOUT_S)
        except Exception as exc:  # a scheduler that is gone or stuck: not ready, never a hung probe
            raise ApiError(503, f"the scheduler did not answer: {type(exc).__name__}", None, "service_unavailable",
                           {"Retry-After": "5"}) from None

    async def scheduler_state() -> SchedulerState:
        return SchedulerState.merged(await shard_states())

    @app.get("/ready", response_model=None, responses={
        200: {"model": ReadyBody, "description": "every scheduler shard serves: a worker in each pool the mode needs"},
        503: {"model": ReadyBody, "description": "a pool has no worker yet, or a scheduler shard did not answer "
                                                "(then an error body)"}})
    async def ready():
        """Readiness: whether a request sent now can be served, with the registered workers."""
        states = await shard_states()
        ok = all(_serves(state) for state in states)  # every shard: a request may hash to any of them
        workers = sorted(w for state in states for w in state.workers)
        return JSONResponse({"ready": ok, "workers": workers}, status_code=200 if ok else 503)

    @app.get("/metrics", response_model=None, responses={
        200: {"description": "Prometheus text: the `tandem:*` metrics (docs/reference/metrics.md)",
              "content": {"text/plain": {"schema": {"type": "string"}}}}})
    async def metrics():
        """The ingress's, the scheduler's and every worker's metrics, read at the time of the scrape."""
        state = await scheduler_state()
        ingress.metrics.update_pools(state.workers)
        ingress.metrics.update_workers(state.worker_stats)
        ingress.metrics.update_tenants(state.tenant_blocks)
        ingress.metrics.update_links(state.links)
        ingress.metrics.update_tiers(await asyncio.to_thread(tier_stats))
        client = ingress.client
        ingress.metrics.update_sockets({"token_sink": client.drops.snapshot(), "scheduler_link": client.link_drops.snapshot(),
                                        "scheduler_port": state.port_drops}, rejected_handshakes())
        return Response(ingress.metrics.render(), media_type="text/plain; version=0.0.4")

    def model_card() -> dict:
        return {"id": ingress.model.name, "object": "model", "created": 0, "owned_by": "tandem",
                "max_model_len": ingress.model.max_model_len}

    @app.get("/v1/models", response_model=None, responses=documented(ModelList, 401))
    async def models(request: Request):
        """The one model this server serves (OpenAI's list shape)."""
        tenant_of(request)  # authenticated by the guard (this fails if the route ever leaves it)
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}", response_model=None, responses=documented(ModelCard, 401, 404))
    async def model(model_id: str, request: Request):
        """The served model's card, with vLLM's `max_model_len`; any other id is a 404."""
        tenant_of(request)  # authenticated by the guard (this fails if the route ever leaves it)
        ingress.model.check_model(model_id)
        return model_card()

    add_token_routes(app, ingress)
    add_responses_route(app, ingress)

    @app.post("/v1/completions", response_model=None,
              responses=documented(CompletionResponse, 400, 401, 404, 408, 413, 429, 500, 503, 504, streams=True))
    async def completions(req: CompletionRequest, request: Request):
        """OpenAI's completions, with vLLM's extras: every field honoured or a 400 naming it (fields.md)."""
        arrival = time.perf_counter()
        tenant = tenant_of(request)
        # echo with max_tokens 0 scores the prompt only: one token is generated and not shown.
        max_tokens = ingress.model.check_common(req, 1 if req.scores_only else req.max_tokens)
        if req.logprobs is not None and not 0 <= req.logprobs <= 20:
            raise ApiError(400, "logprobs must be between 0 and 20", "logprobs")
        structured = await ingress.model.structured_output(req)
        prompts = await ingress.model.encode_prompts(req.prompt, req.truncate_prompt_tokens,
                                                     req.add_special_tokens is not False)
        max_tokens = ingress.model.fit_max_tokens(max_tokens, max(len(p) for p in prompts))
        params = req.sampling_params(max_tokens, req.logprobs, req.wanted_prompt_logprobs(), structured)
        entries = responses.check_logprob_entries(
            ingress.model.caps.max_response_logprobs, [len(p) for p in prompts], req.n,
            0 if req.scores_only else max_tokens, req.logprobs, req.prompt_logprobs, req.echo and req.logprobs is not None)
        opened = await ingress.open_all(prompts, params, tenant, req.timeout, hints_of(req), arrival)
        rid = f"cmpl-{uuid.uuid4().hex}"
        echo_texts = [""] * len(prompts)
        if req.echo:  # (prompts as long as the context: decoded on a worker thread, as the bodies that show them)
            echo_texts = await asyncio.to_thread(
                lambda: [ingress.model.tokenizer.decode(p, skip_special_tokens=True) for p in prompts])
        if req.stream:
            return sse(completion_chunks(ingress, opened, rid, req, echo_texts, arrival),
                        lambda: [ingress.finish(st, arrival) for st in opened])
        await run_unless_disconnected(request, ingress, opened, arrival)
        completion_tokens, cached = 0, 0
        for stream in opened:
            for r in stream.results:
                raise_if_failed(r, stream.own_deadline)
                completion_tokens += 0 if req.scores_only else len(r.token_ids)
            cached += stream.results[0].num_cached_tokens
        usage = ingress.usage(sum(len(p) for p in prompts), completion_tokens, cached)

        def body() -> dict:
            pieces = responses.PieceCache(ingress.model.tokenizer)
            choices = [responses.completion_choice(pieces, req, i * req.n + r.index, echo_texts[i],
                                                   stream.prompt_token_ids, stream.results[0], r)
                       for i, stream in enumerate(opened) for r in stream.results]
            return responses.completion_body(rid, ingress.model.name, choices, usage)
        return await responses.json_response(body, entries)

    @app.post("/v1/chat/completions", response_model=None,
              responses=documented(ChatCompletionResponse, 400, 401, 404, 408, 413, 429, 500, 503, 504, streams=True))
    async def chat(req: ChatCompletionRequest, request: Request):
        """OpenAI's chat completions (tools, structured output), with vLLM's extras: every field honoured or a 400
        naming it (fields.md)."""
        arrival = time.perf_counter()
        tenant = tenant_of(request)
        chat = await prepare_chat(ingress, req)
        prompt, calls = chat.prompt, chat.calls
        entries = responses.check_logprob_entries(ingress.model.caps.max_response_logprobs, [len(prompt)], req.n,
                                                  chat.params.max_tokens, chat.params.logprobs, req.prompt_logprobs,
                                                  echo_logprobs=False)
        (stream,) = await ingress.open_all([prompt], chat.params, tenant, req.timeout, hints_of(req), arrival)
        rid = f"chatcmpl-{uuid.uuid4().hex}"

        def whole() -> dict:
            """The whole answer's body (a streamed one's too, for `store`), kept when `store` asks."""
            usage = ingress.usage(len(prompt), sum(len(r.token_ids) for r in stream.results),
                                  stream.results[0].num_cached_tokens)
            pieces, choices = responses.PieceCache(ingress.model.tokenizer), []
            for r in stream.results:
                lp = responses.chat_logprobs(pieces, r.logprobs, req.return_tokens_as_token_ids) if req.logprobs else None
                message, finish = responses.chat_message(r.text, r.finish_reason, calls)
                choices.append({"index": r.index, "message": message, "logprobs": lp, "finish_reason": finish})
                if req.prompt_logprobs is not None:
                    choices[-1]["prompt_logprobs"] = responses.vllm_prompt_logprobs(pieces, stream.results[0].prompt_logprobs)
            built = responses.chat_body(rid, ingress.model.name, choices, usage, chunk=False)
            if req.store:
                ingress.stored.put(tenant, built)
            return built

        if req.stream:
            chunks = chat_chunks(ingress, stream, rid, req, arrival, calls)
            return sse(_stored_after(chunks, stream, whole) if req.store else chunks,
                       lambda: ingress.finish(stream, arrival))
        await run_unless_disconnected(request, ingress, [stream], arrival)
        for r in stream.results:
            raise_if_failed(r, stream.own_deadline)
        return await responses.json_response(whole, entries)

    @app.get("/v1/chat/completions/{completion_id}", response_model=None,
             responses=documented(ChatCompletionResponse, 401, 404))
    async def stored_chat(completion_id: str, request: Request):
        """A chat completion sent with `store: true`, from the ingress's memory (per tenant; a restart forgets it)."""
        stored = ingress.stored.get(tenant_of(request), completion_id)
        if stored is None or stored.body.get("object") != "chat.completion":
            raise ApiError(404, f"no stored chat completion {completion_id!r}", "completion_id", "not_found_error")
        return stored.body

    without_validation_answers(app)
    return app


def _log_refusal(request: Request, status: int, message: str) -> None:
    """Requests answered 4xx are the client's errors, but an operator needs to see them (a client sending
    a wrong model name, a schema it cannot meet); 5xx are logged where they happen, with the traceback."""
    if 400 <= status < 500:
        log.info("%s %s -> %d: %s", request.method, request.url.path, status, message[:300])


async def _stored_after(chunks: AsyncIterator[dict], stream, keep) -> AsyncIterator[dict]:
    """A streamed answer's chunks, then (every choice ended well) `keep()` on a worker thread: `store`."""
    async for chunk in chunks:
        yield chunk
    if all(r.finish_reason in ("stop", "length") for r in stream.results):
        await asyncio.to_thread(keep)


async def _ref(ref):
    return await ref
