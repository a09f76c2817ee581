"""One HTTP request's life in the cluster: admission through the gate, one cluster request per prompt,
its token events with the request's deadline, and one place where every request ends.

Token deltas arrive on the client's zmq thread and are handed to the event loop through a bounded queue
per request: a client that reads too slowly fills it, and the request is aborted rather than buffered
without bound.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import AsyncIterator

import ray

from actors.engine.structured import GrammarError, Grammars
from actors.protocol.sampling_params import SamplingParams
from actors.protocol.structured_output import StructuredOutput
from cluster.frontend.client import AdmissionRejected, TandemClient
from cluster.frontend.http import responses
from cluster.frontend.http.gate import Gate
from cluster.frontend.http.metrics import IngressMetrics
from cluster.frontend.http.protocol import ApiError, RequestCaps
from cluster.frontend.request_stream import RequestStream, Stalled, StreamEvent

_OVERFLOW = object()
log = logging.getLogger("tandem.ingress")


class _LoopSink:
    """Thread-safe `put` from the zmq thread into a bounded asyncio queue of one request."""

    def __init__(self, loop: asyncio.AbstractEventLoop, maxsize: int, tenant: str | None):
        self.loop = loop
        self.queue: asyncio.Queue = asyncio.Queue(maxsize=maxsize)
        self.overflowed = False
        self.tenant = tenant
        self.closed = False
        self.timeout_s: float | None = None  # the request's own deadline, if it set one

    def put(self, item) -> None:
        self.loop.call_soon_threadsafe(self._put, item)

    def _put(self, item) -> None:
        if self.overflowed:
            return
        try:
            self.queue.put_nowait(item)
        except asyncio.QueueFull:
            self.overflowed = True
            self.queue._queue.clear()  # drop what the slow client never read; the request is aborted
            self.queue.put_nowait(_OVERFLOW)


class Ingress:
    def __init__(self, client: TandemClient, model_name: str, max_model_len: int, gate: Gate, vocab_size: int,
                 caps: RequestCaps = RequestCaps(),
                 max_body_bytes: int = 1 << 20, queue_size: int = 4096, request_timeout_s: float = 600.0,
                 hide_cache_hits: bool = False, chat_template: str | None = None, tool_call_parser: str | None = None):
        self.client = client
        self.tokenizer = client.tokenizer
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.caps = caps
        # Anonymous users of a public ingress share one prefix cache: a reported hit would tell one
        # what another sent.
        self.hide_cache_hits = hide_cache_hits
        self.max_body_bytes = max_body_bytes
        self.queue_size = queue_size
        self.request_timeout_s = request_timeout_s
        self.gate = gate
        self.vocab_size = vocab_size
        self.metrics = IngressMetrics()
        self.chat_template = chat_template  # None: the model's own
        self.tool_call_parser = tool_call_parser
        self._grammars: Grammars | None = None  # compiles structured outputs to check them (made on first use)
        self._emits: dict[str, dict[int, list[float]]] = {}

    def own_deadline(self, sink: _LoopSink) -> bool:
        """Whether the request's own `timeout` (shorter than the server's) set its deadline."""
        return sink.timeout_s is not None and sink.timeout_s < self.request_timeout_s

    def usage(self, prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
        return responses.usage(prompt_tokens, completion_tokens, 0 if self.hide_cache_hits else cached_tokens)

    # ---- one cluster request ----

    async def open(self, prompt_ids: list[int], params: SamplingParams, tenant: str | None,
                   until: float) -> tuple[RequestStream, _LoopSink]:
        """Admit one cluster request that ends TIMED_OUT at `until` (time.monotonic()), wherever it is:
        the stream keeps that deadline, the scheduler (maybe on another host) gets it on the wall clock."""
        started = time.monotonic()
        sink = _LoopSink(asyncio.get_running_loop(), self.queue_size, tenant)
        # The tenant is the cache salt: no request body can choose another tenant's.
        request = self.client.request(prompt_ids, params, tenant, kv_share=self.gate.kv_share(tenant),
                                      deadline=time.time() + (until - started))
        try:
            # Its admission is part of the progress bound: no answer within it is a clean 503.
            await self.client.asubmit(request, sink, timeout_s=self.client.progress_timeout_s)
        except asyncio.TimeoutError:
            self.metrics.rejected.labels("unavailable").inc()
            raise ApiError(503, f"no admission answer within the progress bound ({self.client.progress_timeout_s:.0f}s, "
                                "scheduler.progress_timeout_s); retry", None, "service_unavailable",
                           {"Retry-After": "5"}) from None
        except ray.exceptions.RayError as exc:
            # The scheduler died while admitting it (Ray restarts it): nothing of the request runs.
            self.metrics.rejected.labels("unavailable").inc()
            raise ApiError(503, f"the scheduler was lost while admitting the request ({type(exc).__name__}); retry",
                           None, "service_unavailable", {"Retry-After": "1"}) from None
        except AdmissionRejected as exc:
            if exc.unavailable:
                self.metrics.rejected.labels("unavailable").inc()
                raise ApiError(503, exc.reason, None, "service_unavailable",
                               {"Retry-After": str(max(1, round(exc.retry_after_s)))}) from None
            if exc.retry_after_s is None:
                self.metrics.rejected.labels("inadmissible").inc()
                raise ApiError(400, exc.reason, "max_tokens") from None
            self.metrics.rejected.labels("admission").inc()
            raise ApiError(429, exc.reason, None, "rate_limit_error",
                           {"Retry-After": str(max(1, round(exc.retry_after_s)))}) from None
        self.metrics.prompt_tokens.inc(len(prompt_ids))
        return RequestStream(request, self.tokenizer, started=started, deadline=until), sink

    async def events(self, stream: RequestStream, sink: _LoopSink, arrival: float) -> AsyncIterator[StreamEvent]:
        emits: dict[int, list[float]] = {}
        self._emits[stream.request_id] = emits
        bound = self.client.progress_timeout_s
        try:
            while not stream.finished:
                try:
                    item = await asyncio.wait_for(sink.queue.get(), stream.wait_s(bound))
                except asyncio.TimeoutError:
                    item = stream.silence(bound)  # moved or ended cleanly; past the deadline, TIMED_OUT
                    (self.metrics.stalls.inc() if isinstance(item, Stalled)
                     else self.metrics.rejected.labels("timed_out").inc())
                if item is _OVERFLOW:
                    self.metrics.rejected.labels("slow_client").inc()
                    return
                events = stream.feed(item)
                if stream.migration_pending:
                    self.metrics.migrations.inc()
                    self.client.migrate(stream, sink)
                for ev in events:
                    now = time.perf_counter()
                    emits.setdefault(ev.index, []).extend([now] * len(ev.token_ids))
                    self.metrics.generation_tokens.inc(len(ev.token_ids))
                    yield ev
        finally:
            self.finish(stream, sink, arrival)

    def finish(self, stream: RequestStream, sink: _LoopSink, arrival: float) -> None:
        """Every request ends here exactly once, however its response ended: abort what still runs,
        free the tenant's slot, and record one usage/metrics entry."""
        if sink.closed:
            return
        sink.closed = True
        self.client.finish(stream)
        params = stream.request.params
        self.gate.release(sink.tenant, unused_tokens=max(0, params.max_tokens * params.n - stream.received_tokens))
        emits = self._emits.pop(stream.request_id, {})
        self.metrics.observe_phases(stream.times)
        first = stream.results[0]
        self.metrics.prefix_queries.inc(len(stream.prompt_token_ids))
        self.metrics.prefix_hits.inc(first.num_cached_tokens)
        log.info("usage %s", json.dumps({
            "request_id": stream.request_id, "tenant": sink.tenant, "prompt_tokens": len(stream.prompt_token_ids),
            "cached_tokens": first.num_cached_tokens,
            "generated_tokens": stream.received_tokens,
            "emitted_tokens": sum(len(r.token_ids) for r in stream.results),
            "finish_reasons": [r.finish_reason for r in stream.results],
        }))
        for r in stream.results:
            self.metrics.observe_emits(arrival, emits.get(r.index, []))
            self.metrics.finished.labels(r.finish_reason or "abort").inc()

    async def open_all(self, prompts: list[list[int]], params: SamplingParams, tenant: str | None,
                       timeout_s: float | None = None) -> list:
        """Pass the gate, then open one cluster request per prompt; all or nothing."""
        try:
            params.validate_token_ids(self.vocab_size)
        except ValueError as exc:
            raise ApiError(400, str(exc), str(exc).split("parameter ", 1)[-1].split(":", 1)[0]) from None
        if params.n * len(prompts) > self.caps.max_sequences:
            raise ApiError(400, f"n x prompts = {params.n * len(prompts)}; at most {self.caps.max_sequences} "
                           "sequences per request", "n")
        cost = sum(len(p) for p in prompts) + params.max_tokens * params.n * len(prompts)
        self.gate.admit(tenant, cost, requests=len(prompts))
        # A request's own `timeout` may shorten the server's deadline, never stretch it.
        until = time.monotonic() + min(timeout_s or self.request_timeout_s, self.request_timeout_s)
        opened = []
        try:
            for p in prompts:
                opened.append(await self.open(p, params, tenant, until))
                opened[-1][1].timeout_s = timeout_s
        except BaseException:
            for stream, sink in opened:
                self.finish(stream, sink, 0.0)
            unopened = len(prompts) - len(opened)  # never admitted: nothing of them was generated
            self.gate.release(tenant, unopened, unused_tokens=unopened * params.max_tokens * params.n)
            raise
        return opened

    # ---- prompts ----

    async def encode_prompts(self, prompt) -> list[list[int]]:
        """Token ids of each prompt; the tokenizer runs off the event loop (a long prompt takes a while)."""
        if isinstance(prompt, str):
            raw = [prompt]
        elif prompt and all(isinstance(p, int) for p in prompt):
            raw = [list(prompt)]
        elif isinstance(prompt, list) and prompt:
            raw = list(prompt)
        else:
            raise ApiError(400, "prompt must not be empty", "prompt")
        if len(raw) > self.caps.max_prompts:
            raise ApiError(400, f"prompt holds {len(raw)} prompts; at most {self.caps.max_prompts} per request",
                           "prompt")
        for p in raw:
            if isinstance(p, str):
                check_text(p, "prompt")
        prompts = await asyncio.to_thread(lambda: [self.tokenizer.encode(p) if isinstance(p, str) else list(p)
                                                   for p in raw])
        for p in prompts:
            self.check_prompt(p, "prompt")
        return prompts

    def chat_prompt(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        """The conversation through the chat template, as token ids (call it off the event loop). A
        `developer` message is a system message under OpenAI's newer name: templates know only the old."""
        messages = [{**m, "role": "system"} if m.get("role") == "developer" else m for m in messages]
        try:
            text = self.tokenizer.apply_chat_template(messages, tools=tools, chat_template=self.chat_template,
                                                      tokenize=False, add_generation_prompt=True)
        except Exception as exc:  # a template that rejects the conversation is the client's error
            raise ApiError(400, f"messages: {exc}", "messages") from None
        return self.tokenizer.encode(text, add_special_tokens=False)

    def check_prompt(self, ids: list[int], param: str) -> None:
        if not ids:
            raise ApiError(400, f"{param} must not be empty", param)
        if len(ids) >= self.max_model_len:
            raise ApiError(400, f"{param} has {len(ids)} tokens; this model's context is {self.max_model_len}", param)
        if any(not 0 <= t < self.vocab_size for t in ids):
            raise ApiError(400, f"{param} holds a token id outside the vocabulary [0, {self.vocab_size})", param)

    async def structured_output(self, req) -> StructuredOutput | None:
        """The request's structured output, compiled here first (off the event loop) so that a schema,
        regex or grammar that does not compile is a 400 naming it, before anything is admitted."""
        asked = req.structured_output()
        if asked is None:
            return None
        return await self.check_structured(*asked)

    async def check_structured(self, spec: StructuredOutput, param: str) -> StructuredOutput:
        """Compile `spec` (off the event loop); a 400 naming `param` when it does not."""
        if self._grammars is None:
            made = await asyncio.to_thread(Grammars, self.tokenizer, self.vocab_size)
            self._grammars = self._grammars or made  # another request may have made one meanwhile
        try:
            await asyncio.to_thread(self._grammars.compile, spec)
        except GrammarError as exc:
            raise ApiError(400, f"{param}: {exc}", param) from None
        return spec

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise ApiError(404, f"model {model!r} does not exist; this server serves {self.model_name!r}", "model",
                           "not_found_error")

    def check_common(self, req, max_tokens: int | None) -> int:
        self.check_model(req.model)
        if not 1 <= req.n <= self.caps.max_n:
            raise ApiError(400, f"n must be between 1 and {self.caps.max_n}", "n")
        req.check_limits(self.caps)
        if max_tokens is not None and max_tokens < 1:
            raise ApiError(400, "max_tokens must be at least 1", "max_tokens")
        return max_tokens if max_tokens is not None else self.max_model_len


def check_text(text: str, param: str) -> None:
    """JSON can carry lone surrogates ("\\ud800"), which are not text: a 400 naming the field."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ApiError(400, f"{param} is not valid Unicode (it holds a lone surrogate)", param) from None
