"""Python client of a running cluster: submit requests to the scheduler, stream tokens back over zmq.

Workers push token deltas to the client's sink (token_sink.py), which hands each to its request's inbox.

A `RequestStream` per request is its one record here. One async pump (`pump`) turns its inbox into
events (order, text, stop strings) and keeps its progress bound: the HTTP ingress runs it on its event
loop, the synchronous `events` on this client's own. When a worker was lost the stream asks for a
migration, and `migrate` continues the request elsewhere. Every submit, a first one from a thread or an
event loop and a migration alike, goes out one way (`_send`): from this client's own event loop, batched
per tick, sent again to a scheduler that restarted under it. A cluster may run several scheduler shards,
each with its own workers: the client sends each request to the shard its prompt hashes to (shards.py)
and keeps talking to that one about it.

Why ~400 lines: submit, the pump, the audit of a restarted scheduler and migration all work on the one
request record (`RequestStream`) this client owns; split, each part would reach into it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
import uuid
from dataclasses import dataclass
from typing import AsyncIterator, Iterator

import ray

from actors.protocol.messages import Admitted, AdmittedBy, Forgotten, GenerateRequest, Rejected
from actors.protocol.sampling_params import SamplingParams
from cluster.control.config import SchedulerSection
from cluster.frontend.inbox import OVERFLOW, Inbox
from cluster.frontend.scheduler_link import SchedulerLink
from cluster.frontend.shards import shard_for
from cluster.frontend.token_sink import TokenSink
from cluster.frontend.request_stream import (
    MigrationRefused,
    RequestStream,
    SampleResult,
    SchedulerForgot,
    StreamEvent,
)
from kv_transfer.curve import CurveKeys
from kv_transfer.drops import DropCounter

log = logging.getLogger("tandem.client")
# How often to ask Ray again where a scheduler that is restarting listens (scheduler_link.py).
_RESEND_S = 0.5
# A caller's thread waits on the client's event loop at most this long past what the loop itself bounds:
# a loop that is blocked or gone must end the call with an error, never hang it.
_LOOP_GRACE_S = 30.0
_DEFAULTS = SchedulerSection()


class AdmissionRejected(RuntimeError):
    """The scheduler did not admit the request. `retry_after_s` None: it never will, as it is."""

    def __init__(self, rejected: Rejected):
        hint = "not admissible as it is" if rejected.retry_after_s is None else f"retry after {rejected.retry_after_s:.1f}s"
        super().__init__(f"request rejected: {rejected.reason} ({hint})")
        self.reason, self.retry_after_s, self.unavailable = rejected.reason, rejected.retry_after_s, rejected.unavailable


@dataclass
class Submitted:
    stream: RequestStream  # the request's one record on this side (its inbox, shard and epoch included)
    route: Admitted  # the scheduler's answer: which workers prefill and decode it, cached tokens

    @property
    def request(self) -> GenerateRequest:
        return self.stream.request

    @property
    def request_id(self) -> str:
        return self.stream.request_id


class TandemClient:
    def __init__(self, scheduler, tokenizer=None, host: str = "127.0.0.1", keys: CurveKeys | None = None,
                 audit_s: float = 2.0, progress_timeout_s: float = _DEFAULTS.progress_timeout_s):
        """`scheduler`: the scheduler actor, or a list of scheduler shards (each with its own workers; a
        request goes to `shard_for` its prompt). `keys`: the cluster's data-plane keys (`open_client`
        passes them; `connect` fetches them). `audit_s`: how often to ask the schedulers whether a
        restart lost any request in flight. `progress_timeout_s`: the most a request may go without any
        news before it is moved, then failed (request_stream.py)."""
        self.progress_timeout_s = progress_timeout_s
        self.schedulers = list(scheduler) if isinstance(scheduler, (list, tuple)) else [scheduler]
        self.scheduler = self.schedulers[0]
        self.tokenizer = tokenizer
        self._listening: dict[str, RequestStream] = {}  # this client's one record of each request, by id
        self._latest: list[str | None] = [None] * len(self.schedulers)  # each shard's latest incarnation heard of
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._sink = TokenSink(host, keys, self._inbox_of)
        self.sink, self.drops = self._sink.endpoint, self._sink.drops
        self.link_drops = DropCounter("scheduler_link")
        self._audit_s = audit_s
        # Every submit and abort goes out from this loop (sync callers wait on it; see `_send`), over each
        # shard's link, batched per tick.
        self._loop = asyncio.new_event_loop()
        threading.Thread(target=self._loop.run_forever, name="tandem-client-loop", daemon=True).start()
        self._links = [SchedulerLink(shard, keys, self.link_drops) for shard in self.schedulers]
        threading.Thread(target=self._audit_loop, name="tandem-client-audit", daemon=True).start()

    @classmethod
    def connect(cls, scheduler, tokenizer=None, host: str = "127.0.0.1", timeout_s: float = 30.0,
                progress_timeout_s: float = _DEFAULTS.progress_timeout_s) -> TandemClient:
        """A client of a running cluster: its keys come from the scheduler, through Ray."""
        first = scheduler[0] if isinstance(scheduler, (list, tuple)) else scheduler
        keys = ray.get(first.data_plane_keys.remote(), timeout=timeout_s)
        return cls(scheduler, tokenizer, host, keys, progress_timeout_s=progress_timeout_s)

    @property
    def sink_alive(self) -> bool:
        """False once the receiving thread has ended: no token can reach any request any more."""
        return self._sink.alive

    def kill_sink(self) -> None:
        """Chaos hook: end the receiving thread as a crash would (health checks must notice)."""
        self._sink.kill()

    def _inbox_of(self, request_id: str):
        with self._lock:
            listening = self._listening.get(request_id)
        return None if listening is None else listening.inbox

    def _audit_loop(self) -> None:
        while not self._closed.wait(self._audit_s):
            if not self._listening or not ray.is_initialized():
                continue  # nothing in flight to lose
            try:
                self.audit()
            except ray.exceptions.RayError:
                pass  # the scheduler is restarting: ask again next round
            except Exception:  # the audit must outlive anything one round does
                log.exception("request audit failed")

    def audit(self, timeout_s: float = 10.0) -> list[Forgotten]:
        """Ask each scheduler shard about requests admitted by an incarnation other than the latest one
        heard of (none, unless it restarted): the ones it re-learned are its own now, the lost ones migrate."""
        return [self._audit(shard, timeout_s) for shard in range(len(self.schedulers))]

    def _audit(self, shard: int, timeout_s: float) -> Forgotten:
        with self._lock:
            asked = tuple(AdmittedBy(rid, r.epoch) for rid, r in self._listening.items()
                          if r.epoch is not None and r.epoch != self._latest[shard] and r.shard == shard)
        answer: Forgotten = ray.get(self.schedulers[shard].forgotten.remote(asked), timeout=timeout_s)
        with self._lock:
            self._latest[shard] = answer.epoch
            for rid in answer.known:
                if rid in self._listening:
                    self._listening[rid].epoch = answer.epoch
            lost = [(rid, self._listening[rid]) for rid in answer.lost
                    if rid in self._listening and self._listening[rid].epoch is not None]
            for _, listening in lost:
                listening.epoch = None  # its stream migrates it (or fails): not lost twice
        for rid, listening in lost:
            log.warning("request %s was lost with a restarted scheduler: migrating it", rid)
            listening.inbox.put(SchedulerForgot(answer.epoch))
        return answer

    def close(self) -> None:
        self._closed.set()
        self._sink.close()
        try:
            asyncio.run_coroutine_threadsafe(_close_all(self._links), self._loop).result(timeout=5)
        except concurrent.futures.TimeoutError:
            log.warning("the client's links to the scheduler did not close within 5s")
        self._loop.call_soon_threadsafe(self._loop.stop)

    # ---- requests ----

    def request(self, prompt: str | list[int], params: SamplingParams, cache_salt: str | None = None,
                request_id: str | None = None, kv_share: float | None = None,
                deadline: float | None = None, priority: int = 0, affinity: str | None = None) -> GenerateRequest:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this client has no tokenizer: pass the prompt as token ids")
            prompt = self.tokenizer.encode(prompt)
        return GenerateRequest(request_id or uuid.uuid4().hex, tuple(prompt), params, self.sink, cache_salt,
                               kv_share, deadline, priority=priority, affinity=affinity)

    def submit(self, prompt: str | list[int], params: SamplingParams, cache_salt: str | None = None,
               request_id: str | None = None, timeout_s: float = 60.0, deltas=None) -> Submitted:
        """Admit one request; its raw token deltas go to `deltas` if given (anything with a thread-safe
        `put`; one may serve many requests), else to an inbox of its own that `events` reads."""
        request = self.request(prompt, params, cache_salt, request_id)
        stream = self._listen(request, deltas or Inbox(self._loop))
        try:
            answer = self._on_loop(self._send(request, timeout_s), timeout_s, request.request_id)
        except BaseException:
            self.forget(request.request_id)
            raise
        return self._admitted(stream, answer)

    async def asubmit(self, request: GenerateRequest, deltas=None, timeout_s: float = 60.0,
                      deadline: float | None = None, own_deadline: bool = False) -> Submitted:
        """`submit` for an event loop: its deltas go to `deltas` if given, else to an unbounded inbox on
        this loop, which `pump` reads. `deadline` (time.monotonic()): when the request ends TIMED_OUT
        wherever it is; `own_deadline`: the caller's own choice (an HTTP `timeout`), not the server's."""
        stream = self._listen(request, deltas or Inbox(asyncio.get_running_loop()), deadline, own_deadline)
        try:
            answer = await asyncio.wrap_future(self._send(request, timeout_s))
        except BaseException:
            self.forget(request.request_id)
            raise
        return self._admitted(stream, answer)

    def _send(self, request: GenerateRequest, timeout_s: float) -> concurrent.futures.Future:
        """The one way a request reaches its scheduler shard, a first submit and a migration alike: on this
        client's own event loop, where the submits of one tick travel in one frame (scheduler_link.py)."""
        if self._closed.is_set():  # its loop is stopped: nothing would ever answer
            raise RuntimeError("this client is closed")
        return asyncio.run_coroutine_threadsafe(self._submit_until(request, timeout_s), self._loop)

    async def _submit_until(self, request: GenerateRequest, timeout_s: float) -> Admitted | Rejected:
        """The scheduler's answer, until `timeout_s` (then TimeoutError). A scheduler that died under the
        submit gets it again once restarted (its link does that); one that Ray cannot place yet is asked
        again every `_RESEND_S`."""
        give_up_at = time.monotonic() + timeout_s
        link = self._links[self._shard_of(request.request_id)]
        while True:
            try:
                return await asyncio.wait_for(link.submit(request), give_up_at - time.monotonic())
            except ray.exceptions.RayError:
                if time.monotonic() + _RESEND_S >= give_up_at:
                    raise
                await asyncio.sleep(_RESEND_S)

    def _listen(self, request: GenerateRequest, deltas, deadline: float | None = None,
                own_deadline: bool = False) -> RequestStream:
        """The request's record, made as it is sent (its progress bound counts the admission too)."""
        stream = RequestStream(request, self.tokenizer, deadline=deadline)
        stream.own_deadline = own_deadline
        stream.inbox = deltas
        stream.shard = shard_for(request.prompt_token_ids, request.cache_salt, len(self.schedulers))
        with self._lock:
            self._listening[request.request_id] = stream
        return stream

    def _admitted(self, stream: RequestStream, answer: Admitted | Rejected) -> Submitted:
        if isinstance(answer, Rejected):
            self.forget(stream.request_id)
            raise AdmissionRejected(answer)
        self._admitted_by(stream.request_id, answer.epoch)
        stream.routes.append(answer)
        return Submitted(stream, answer)

    def _admitted_by(self, request_id: str, epoch: str | None) -> None:
        with self._lock:
            listening = self._listening.get(request_id)
            if listening is None:
                return
            listening.epoch = epoch
            if epoch is not None and self._latest[listening.shard] is None:
                self._latest[listening.shard] = epoch

    def migrate(self, stream: RequestStream) -> None:
        """Resubmit a request whose worker was lost, continuing after the tokens the client already has.
        Never blocks: a refusal arrives in its inbox as a `MigrationRefused`, after which the stream fails."""
        request = stream.migration_request()
        self._admitted_by(request.request_id, None)  # not audited while its admission is pending

        def answered(future: concurrent.futures.Future) -> None:
            try:
                answer = future.result()
            except Exception as exc:  # the scheduler is unreachable for the whole bound: the request ends here
                answer = Rejected(f"{type(exc).__name__}: {exc}", None)
            if isinstance(answer, Rejected):
                stream.inbox.put(MigrationRefused(answer.reason))
            else:
                self._admitted_by(request.request_id, answer.epoch)
                stream.routes.append(answer)

        self._send(request, self.progress_timeout_s).add_done_callback(answered)

    def stream(self, prompt: str | list[int], params: SamplingParams, cache_salt: str | None = None,
               timeout_s: float = 120.0) -> Iterator[StreamEvent]:
        """Submit one request and yield its events as they arrive; aborts it if the caller stops early."""
        return self.events(self.submit(prompt, params, cache_salt), timeout_s)

    def events(self, submitted: Submitted, timeout_s: float = 120.0) -> Iterator[StreamEvent]:
        """The events of a submitted request, in order, until `timeout_s` after it was sent (then it ends
        TIMED_OUT); aborts it if the caller stops early. Its pump runs on this client's own event loop."""
        stream = submitted.stream
        stream.deadline = stream.started + timeout_s
        return self._events_on_loop(stream)

    def _events_on_loop(self, stream: RequestStream) -> Iterator[StreamEvent]:
        pumping = self.pump(stream)
        try:
            while True:
                if self._closed.is_set():
                    raise RuntimeError("this client is closed")
                try:
                    # The pump ends the request at its deadline at the latest.
                    yield self._on_loop(asyncio.run_coroutine_threadsafe(pumping.__anext__(), self._loop),
                                        max(stream.deadline - time.monotonic(), 0.0), stream.request_id)
                except StopAsyncIteration:
                    return
        finally:
            if not self._closed.is_set():
                try:
                    asyncio.run_coroutine_threadsafe(pumping.aclose(), self._loop).result(timeout=_LOOP_GRACE_S)
                except concurrent.futures.TimeoutError:
                    log.warning("request %s: the client's event loop did not close its pump", stream.request_id)
            self.finish(stream)

    def _on_loop(self, future: concurrent.futures.Future, bound_s: float, request_id: str):
        """The result of work on the client's loop, which bounds it by `bound_s` itself; a loop that has not
        answered `_LOOP_GRACE_S` later is blocked or gone: an error, not a hang."""
        try:
            return future.result(timeout=bound_s + _LOOP_GRACE_S)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise RuntimeError(f"request {request_id}: the client's event loop gave no answer within "
                               f"{bound_s + _LOOP_GRACE_S:.0f}s (blocked or stopped)") from None

    def generate(self, prompts: list, params: SamplingParams | list[SamplingParams],
                 cache_salt: str | None = None, timeout_s: float = 300.0) -> list[list[SampleResult]]:
        """Submit every prompt at once; return each request's samples, in prompt order."""
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        submitted = [self.submit(p, sp, cache_salt) for p, sp in zip(prompts, params_list)]
        results = []
        for handle in submitted:
            for _ in self.events(handle, timeout_s):
                pass
            results.append(handle.stream.results)
        return results

    async def pump(self, stream: RequestStream) -> AsyncIterator[StreamEvent]:
        """The one pump of a request (on the event loop of its inbox): its events in order, moving it when
        its worker is lost or it stalls, ending it cleanly at its progress bound or deadline. It stops
        early when the inbox overflowed (a reader too slow; the request is then aborted). The caller
        ends the request with `finish` once it stops reading."""
        bound = self.progress_timeout_s
        while not stream.finished:
            try:
                item = await stream.inbox.get(stream.wait_s(bound))
            except asyncio.TimeoutError:
                item = stream.silence(bound)  # moved, or ended cleanly
            if item is OVERFLOW:
                return
            events = stream.feed(item)
            if stream.migration_pending:
                self.migrate(stream)
            for event in events:
                stream.went_out(event)
                yield event

    def finish(self, stream: RequestStream) -> None:
        """Stop listening for a request (once; later calls do nothing); abort it in the cluster if it may
        still be generating."""
        if stream.closed:
            return
        stream.closed = True
        if stream.needs_abort:
            self.abort(stream.request_id)
        self.forget(stream.request_id)

    def abort(self, request_id: str, give_up_s: float = 300.0) -> None:
        """Abort a request in the cluster, without blocking. A scheduler that is restarting cannot take
        it now, and a lost abort would let the request run to its end: it is sent again until the
        scheduler took it (or `give_up_s`)."""
        if self._closed.is_set():
            return
        link = self._links[self._shard_of(request_id)]  # now: the request is forgotten before the abort lands
        asyncio.run_coroutine_threadsafe(self._abort_until(link, request_id, give_up_s), self._loop)

    async def _abort_until(self, link: SchedulerLink, request_id: str, give_up_s: float) -> None:
        give_up_at = time.monotonic() + give_up_s
        while True:
            try:
                await asyncio.wait_for(link.abort((request_id,)), give_up_at - time.monotonic())
                return
            except ray.exceptions.RayError:  # Ray cannot say where the scheduler listens: it is restarting
                if time.monotonic() + 1.0 >= give_up_at:
                    return
                await asyncio.sleep(1.0)
            except asyncio.TimeoutError:
                log.warning("gave up aborting request %s after %.0fs: no scheduler took it", request_id, give_up_s)
                return

    def forget(self, request_id: str) -> None:
        with self._lock:
            self._listening.pop(request_id, None)

    def _shard_of(self, request_id: str) -> int:
        """The shard that admits the request (the first one for a request this client does not track)."""
        with self._lock:
            listening = self._listening.get(request_id)
        return listening.shard if listening is not None else 0


async def _close_all(links: list[SchedulerLink]) -> None:
    await asyncio.gather(*(link.close() for link in links))

