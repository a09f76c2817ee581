"""Python client of a running cluster: submit requests to the scheduler, stream tokens back over zmq.

The client binds one PULL socket (its sink); workers push one message per engine step to it. Deltas
of one sample are put back in order by their offset (the first token comes from the prefill worker,
the rest from the decode worker). Text, stop strings and their abort are handled here, as the HTTP
ingress will: workers only produce token ids.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Iterator

import ray
import zmq

from actors.protocol.sampling_params import SamplingParams
from actors.protocol.token_stream import decode_deltas
from cluster.control.scheduler_state import attempt_of
from cluster.frontend.request_stream import RequestStream, SampleResult, StreamEvent
from kv_transfer.endpoints import advertised_host


class AdmissionRejected(RuntimeError):
    """The scheduler did not admit the request. `retry_after_s` None: it never will, as it is."""

    def __init__(self, reason: str, retry_after_s: float | None, unavailable: bool = False):
        hint = "not admissible as it is" if retry_after_s is None else f"retry after {retry_after_s:.1f}s"
        super().__init__(f"request rejected: {reason} ({hint})")
        self.reason, self.retry_after_s, self.unavailable = reason, retry_after_s, unavailable


@dataclass
class Submitted:
    request_id: str
    prompt_token_ids: list[int]
    queue: queue.Queue
    route: dict  # the scheduler's answer: which workers prefill and decode it, cached tokens
    request: dict  # as sent, to migrate it after a worker loss


class TandemClient:
    def __init__(self, scheduler, tokenizer=None, host: str = "127.0.0.1"):
        self.scheduler = scheduler
        self.tokenizer = tokenizer
        self._socket = zmq.Context.instance().socket(zmq.PULL)
        self._socket.setsockopt(zmq.LINGER, 0)
        port = self._socket.bind_to_random_port(f"tcp://{host}")
        self.sink = f"tcp://{advertised_host(host)}:{port}"  # workers on other nodes connect to it
        self._queues: dict[str, queue.Queue] = {}
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._receive, name="tandem-client-sink", daemon=True)
        self._thread.start()

    def _receive(self) -> None:
        poller = zmq.Poller()
        poller.register(self._socket, zmq.POLLIN)
        while not self._closed.is_set():
            if not poller.poll(100):
                continue
            for delta in decode_deltas(self._socket.recv()):
                with self._lock:
                    q = self._queues.get(attempt_of(delta.request_id))
                if q is not None:
                    q.put(delta)

    def close(self) -> None:
        self._closed.set()
        self._thread.join(timeout=5)
        self._socket.close(linger=0)

    # ---- requests ----

    def submit(self, prompt: str | list[int], params: SamplingParams, cache_salt: str | None = None,
               request_id: str | None = None, timeout_s: float = 60.0,
               deltas: queue.Queue | None = None) -> Submitted:
        """Admit one request; its raw token deltas go to `deltas` if given (one queue may serve many
        requests, read by one thread), else to a queue of its own that `events` reads."""
        request, q = self._prepare(prompt, params, cache_salt, request_id, deltas)
        try:
            answer = ray.get(self.scheduler.submit.remote(request), timeout=timeout_s)
        except BaseException:
            self.forget(request["request_id"])
            raise
        return self._admitted(request, q, answer)

    async def asubmit(self, prompt: str | list[int], params: SamplingParams, cache_salt: str | None = None,
                      deltas=None, timeout_s: float = 60.0) -> Submitted:
        """`submit` for an event loop; `deltas` needs only a thread-safe `put`."""
        request, q = self._prepare(prompt, params, cache_salt, None, deltas)
        try:
            answer = await asyncio.wait_for(_awaitable(self.scheduler.submit.remote(request)), timeout_s)
        except BaseException:
            self.forget(request["request_id"])
            raise
        return self._admitted(request, q, answer)

    def _prepare(self, prompt, params: SamplingParams, cache_salt, request_id, deltas) -> tuple[dict, object]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this client has no tokenizer: pass the prompt as token ids")
            prompt = self.tokenizer.encode(prompt)
        request_id = request_id or uuid.uuid4().hex
        q = deltas if deltas is not None else queue.Queue()
        with self._lock:
            self._queues[request_id] = q
        request = {
            "request_id": request_id, "prompt_token_ids": list(prompt), "params": _params_dict(params),
            "cache_salt": cache_salt, "sink": self.sink,
        }
        return request, q

    def _admitted(self, request: dict, q, answer: dict) -> Submitted:
        if "rejected" in answer:
            self.forget(request["request_id"])
            raise AdmissionRejected(answer["rejected"], answer["retry_after_s"], answer.get("unavailable", False))
        return Submitted(request["request_id"], request["prompt_token_ids"], q, answer, request)

    def stream(self, prompt: str | list[int], params: SamplingParams, cache_salt: str | None = None,
               timeout_s: float = 120.0) -> Iterator[StreamEvent]:
        """Submit one request and yield its events as they arrive; aborts it if the caller stops early."""
        return self.events(self.submit(prompt, params, cache_salt), params, timeout_s)

    def events(self, submitted: Submitted, params: SamplingParams, timeout_s: float = 120.0) -> Iterator[StreamEvent]:
        """The events of a submitted request, in order; aborts it if the caller stops early."""
        stream = RequestStream(submitted.request_id, submitted.prompt_token_ids, params, self.tokenizer)
        return self._pump(submitted, stream, timeout_s)

    def generate(self, prompts: list, params: SamplingParams | list[SamplingParams],
                 cache_salt: str | None = None, timeout_s: float = 300.0) -> list[list[SampleResult]]:
        """Submit every prompt at once; return each request's samples, in prompt order."""
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        submitted = [self.submit(p, sp, cache_salt) for p, sp in zip(prompts, params_list)]
        results = []
        for handle, sp in zip(submitted, params_list):
            stream = RequestStream(handle.request_id, handle.prompt_token_ids, sp, self.tokenizer)
            for _ in self._pump(handle, stream, timeout_s):
                pass
            results.append(stream.results)
        return results

    def _pump(self, submitted: Submitted, stream: RequestStream, timeout_s: float) -> Iterator[StreamEvent]:
        deadline = time.monotonic() + timeout_s
        try:
            while not stream.finished:
                remaining = deadline - time.monotonic()
                try:
                    delta = submitted.queue.get(timeout=max(remaining, 0.001))
                except queue.Empty:
                    raise TimeoutError(f"request {submitted.request_id} produced nothing for {timeout_s}s") from None
                yield from stream.feed(delta)
                if stream.migration_pending:
                    yield from self._migrate(submitted, stream)
        finally:
            if stream.needs_abort:
                self.scheduler.abort.remote(submitted.request_id)
            self.forget(submitted.request_id)

    def _migrate(self, submitted: Submitted, stream: RequestStream) -> Iterator[StreamEvent]:
        """Resubmit a request whose worker was lost, continuing after the tokens it already emitted."""
        request = stream.migration_request(submitted.request)
        with self._lock:
            self._queues[submitted.request_id] = submitted.queue
        try:
            answer = ray.get(self.scheduler.submit.remote(request), timeout=60)
        except Exception as exc:  # the scheduler itself is unreachable: the request ends here
            answer = {"rejected": str(exc)}
        if "rejected" in answer:
            yield from stream.fail(f"worker lost and the request could not be migrated: {answer['rejected']}")

    def forget(self, request_id: str) -> None:
        with self._lock:
            self._queues.pop(request_id, None)


def _params_dict(params: SamplingParams) -> dict:
    return {k: v for k, v in vars(params).items()}


async def _awaitable(ref):
    return await ref
