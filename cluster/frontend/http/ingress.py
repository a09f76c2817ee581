"""One HTTP request's life in the cluster: admission through the gate, one cluster request per prompt,
its token events with the request's deadline, and one place where every request ends. What is served,
and how a request is checked before any of that, is `ServedModel` (served_model.py).

A request's record is the client's `RequestStream`, and its events come from the client's one pump
(`TandemClient.pump`) on this event loop; what the ingress adds is the HTTP side: its inbox is bounded
(a client that reads too slowly fills it, and the request is aborted rather than buffered without
bound), and its end frees the tenant's slot and records usage and metrics.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import AsyncIterator

import ray

from actors.protocol.sampling_params import SamplingParams
from cluster.frontend.client import AdmissionRejected, TandemClient
from cluster.frontend.http import responses
from cluster.frontend.http.gate import Gate
from cluster.frontend.http.metrics import IngressMetrics
from cluster.frontend.http.protocol import ApiError
from cluster.frontend.http.request_hints import AdmissionHints
from cluster.frontend.http.request_spans import RequestSpans
from cluster.frontend.http.response_store import ResponseStore
from cluster.frontend.http.served_model import ServedModel
from cluster.frontend.inbox import Inbox
from cluster.frontend.request_stream import DELIVERY_S, RequestStream, StreamEvent

log = logging.getLogger("tandem.ingress")


class Ingress:
    def __init__(self, client: TandemClient, model: ServedModel, gate: Gate, max_body_bytes: int = 1 << 20,
                 queue_size: int = 4096, request_timeout_s: float = 600.0, hide_cache_hits: bool = False,
                 tenant_metrics: bool = False, stored: ResponseStore | None = None, tracer=None):
        """`tracer`: the ingress's OpenTelemetry tracer (actors/tracing/tracer.py); None: tracing is off."""
        self.client = client
        self.spans = RequestSpans(tracer)  # one span per cluster request, continued by the scheduler and workers
        self.stored = stored or ResponseStore(1024, 64 << 20)  # `store`: previous_response_id, GET by id
        self.model = model  # what is served, and how a request's prompt and fields are checked (served_model.py)
        # Anonymous users of a public ingress share one prefix cache: a reported hit would tell one
        # what another sent.
        self.hide_cache_hits = hide_cache_hits
        self.max_body_bytes = max_body_bytes
        self.queue_size = queue_size
        self.request_timeout_s = request_timeout_s
        self.gate = gate
        self.metrics = IngressMetrics(tenant_labels=tenant_metrics)  # ingress.metrics_tenant_labels
        self._labels: dict[str, dict] = {}  # request id -> who the request is for (`AdmissionHints.labels`), for its usage record

    def usage(self, prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
        return responses.usage(prompt_tokens, completion_tokens, 0 if self.hide_cache_hits else cached_tokens)

    # ---- one cluster request ----

    async def open(self, prompt_ids: list[int], params: SamplingParams, tenant: str | None,
                   until: float, own_deadline: bool, arrival: float | None = None,
                   hints: AdmissionHints = AdmissionHints()) -> RequestStream:
        """Admit one cluster request that ends TIMED_OUT at `until` (time.monotonic()), wherever it is:
        the stream keeps that deadline, the scheduler (maybe on another host) gets it on the wall clock.
        `arrival` (time.perf_counter()): when its HTTP request reached the ingress (None: now)."""
        started = time.monotonic()
        # The tenant is the cache salt: no request body can choose another tenant's.
        request = self.client.request(prompt_ids, params, tenant, kv_share=self.gate.kv_share(tenant),
                                      deadline=time.time() + (until - started), priority=hints.priority,
                                      affinity=hints.affinity)
        request = self.spans.opened(request)
        # Its admission is part of the progress bound, counted from its arrival here: no answer within it is a
        # clean 503, decided a moment before the bound (as a stream's end is) so that it reaches the client in it.
        spent_s = time.perf_counter() - arrival if arrival is not None else 0.0
        admission_s = max(self.client.progress_timeout_s - DELIVERY_S - spent_s, 0.0)
        try:
            submitted = await self._submit(request, admission_s, until, own_deadline)
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
        return submitted.stream

    async def _submit(self, request, admission_s: float, until: float, own_deadline: bool):
        try:
            return await self.client.asubmit(request, Inbox(asyncio.get_running_loop(), self.queue_size),
                                             admission_s, until, own_deadline)
        except BaseException as exc:  # never admitted: its span ends here
            self.spans.refused(request.request_id, exc)
            raise

    async def events(self, stream: RequestStream, arrival: float) -> AsyncIterator[StreamEvent]:
        """The request's events from the client's pump, until it ends (then `finish`)."""
        try:
            async for ev in self.client.pump(stream):
                self.metrics.generation_tokens.inc(len(ev.token_ids))
                yield ev
        finally:
            self.finish(stream, arrival)

    def finish(self, stream: RequestStream, arrival: float) -> None:
        """Every request ends here exactly once, however its response ended: abort what still runs,
        free the tenant's slot, and record one usage/metrics entry."""
        if stream.closed:
            return
        self.client.finish(stream)
        self.spans.finished(stream)
        tenant = stream.request.cache_salt  # the tenant is the cache salt (`open`)
        params = stream.request.params
        self.gate.release(tenant, unused_tokens=max(0, params.max_tokens * params.n - stream.received_tokens))
        self.metrics.stalls.inc(stream.stalls)
        self.metrics.migrations.inc(stream.moves)
        if stream.timed_out:
            self.metrics.rejected.labels("timed_out").inc()
        if stream.inbox.overflowed:
            self.metrics.rejected.labels("slow_client").inc()
        self.metrics.observe_phases(stream.times)
        first = stream.results[0]
        self.metrics.prefix_queries.inc(len(stream.prompt_token_ids))
        self.metrics.prefix_hits.inc(first.num_cached_tokens)
        log.info("usage %s", json.dumps({
            "request_id": stream.request_id, "tenant": tenant, **self._labels.pop(stream.request_id, {}),
            "prompt_tokens": len(stream.prompt_token_ids),
            "cached_tokens": first.num_cached_tokens,
            "generated_tokens": stream.received_tokens,
            "emitted_tokens": sum(len(r.token_ids) for r in stream.results),
            "finish_reasons": [r.finish_reason for r in stream.results],
        }))
        for r in stream.results:
            self.metrics.observe_emits(arrival, stream.emitted.get(r.index, []), stream.routes)
            self.metrics.finished.labels(r.finish_reason or "abort").inc()

    async def open_all(self, prompts: list[list[int]], params: SamplingParams, tenant: str | None,
                       timeout_s: float | None = None, hints: AdmissionHints = AdmissionHints(),
                       arrival: float | None = None) -> list:
        """Pass the gate, then open one cluster request per prompt; all or nothing. `hints`: who the request
        is for (named in each request's usage record) and how the scheduler should order and route it;
        `arrival` (time.perf_counter()): when the HTTP request reached the ingress."""
        try:
            params.validate_token_ids(self.model.vocab_size)
        except ValueError as exc:
            raise ApiError(400, str(exc), str(exc).split("parameter ", 1)[-1].split(":", 1)[0]) from None
        if params.n * len(prompts) > self.model.caps.max_sequences:
            raise ApiError(400, f"n x prompts = {params.n * len(prompts)}; at most {self.model.caps.max_sequences} "
                           "sequences per request", "n")
        cost = sum(len(p) for p in prompts) + params.max_tokens * params.n * len(prompts)
        self.gate.admit(tenant, cost, requests=len(prompts))
        # A request's own `timeout` may shorten the server's deadline, never stretch it.
        until = time.monotonic() + min(timeout_s or self.request_timeout_s, self.request_timeout_s)
        own = timeout_s is not None and timeout_s < self.request_timeout_s
        opened = []
        try:
            for p in prompts:
                opened.append(await self.open(p, params, tenant, until, own, arrival, hints))
                if hints.labels:
                    self._labels[opened[-1].request_id] = hints.labels
        except BaseException:
            for stream in opened:
                self.finish(stream, 0.0)
            unopened = len(prompts) - len(opened)  # never admitted: nothing of them was generated
            self.gate.release(tenant, unopened, unused_tokens=unopened * params.max_tokens * params.n)
            raise
        return opened


