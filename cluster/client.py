"""Python client of a running cluster: submit requests to the scheduler, stream tokens back over zmq.

The client binds one PULL socket (its sink); workers push one message per engine step to it. Deltas
of one sample are put back in order by their offset (the first token comes from the prefill worker,
the rest from the decode worker). Text, stop strings and their abort are handled here, as the HTTP
ingress will: workers only produce token ids.
"""

from __future__ import annotations

import queue
import threading
import time
import uuid
from dataclasses import asdict, dataclass, field
from typing import Iterator

import ray
import zmq

from actors.detokenizer import IncrementalDetokenizer
from actors.request_status import RequestStatus
from actors.sampling_params import SamplingParams
from actors.token_stream import TokenDelta, decode_deltas


class AdmissionRejected(RuntimeError):
    def __init__(self, reason: str, retry_after_s: float):
        super().__init__(f"request rejected: {reason} (retry after {retry_after_s:.1f}s)")
        self.reason, self.retry_after_s = reason, retry_after_s


@dataclass
class SampleResult:
    index: int
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    status: RequestStatus = RequestStatus.WAITING
    error: str | None = None
    num_cached_tokens: int = 0

    @property
    def finish_reason(self) -> str | None:
        return self.status.finish_reason()


@dataclass
class StreamEvent:
    index: int
    token_ids: list[int]
    text: str
    finished: bool
    finish_reason: str | None
    error: str | None = None


class _Sample:
    """One sample's stream: reorders deltas by offset, detokenizes, watches for stop strings."""

    def __init__(self, index: int, detokenizer: IncrementalDetokenizer | None):
        self.result = SampleResult(index)
        self._pending: dict[int, TokenDelta] = {}
        self._detok = detokenizer

    def feed(self, delta: TokenDelta) -> list[StreamEvent]:
        if not delta.token_ids and RequestStatus(delta.status).is_finished():
            return [self._apply(delta)]  # a failure carries no tokens and ends the sample wherever it is
        self._pending[delta.offset] = delta
        events = []
        while not self.result.status.is_finished():
            d = self._pending.pop(len(self.result.token_ids), None)
            if d is None:
                break
            events.append(self._apply(d))
        return events

    def _apply(self, d: TokenDelta) -> StreamEvent:
        r = self.result
        r.token_ids.extend(d.token_ids)
        r.num_cached_tokens = d.num_cached_tokens
        status = RequestStatus(d.status)
        text = ""
        if self._detok is not None and d.token_ids:
            out = self._detok.add_tokens(d.token_ids)
            text = out.new_text
            if out.stop_hit is not None:
                status = RequestStatus.FINISHED_STOPPED
        if status.is_finished() and self._detok is not None and self._detok.stop_hit is None:
            text += self._detok.flush()
        r.text += text
        r.status = status if status.is_finished() else RequestStatus.DECODING
        r.error = d.error
        return StreamEvent(r.index, d.token_ids, text, status.is_finished(), status.finish_reason(), d.error)


@dataclass
class Submitted:
    request_id: str
    prompt_token_ids: list[int]
    queue: queue.Queue
    route: dict  # the scheduler's answer: which workers prefill and decode it, cached tokens


class TandemClient:
    def __init__(self, scheduler, tokenizer=None, host: str = "127.0.0.1"):
        self.scheduler = scheduler
        self.tokenizer = tokenizer
        self._socket = zmq.Context.instance().socket(zmq.PULL)
        self._socket.setsockopt(zmq.LINGER, 0)
        port = self._socket.bind_to_random_port(f"tcp://{host}")
        self.sink = f"tcp://{host}:{port}"
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
                    q = self._queues.get(delta.request_id)
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
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this client has no tokenizer: pass the prompt as token ids")
            prompt = self.tokenizer.encode(prompt)
        request_id = request_id or uuid.uuid4().hex
        q: queue.Queue = deltas if deltas is not None else queue.Queue()
        with self._lock:
            self._queues[request_id] = q
        request = {
            "request_id": request_id, "prompt_token_ids": list(prompt), "params": _params_dict(params),
            "cache_salt": cache_salt, "sink": self.sink,
        }
        try:
            answer = ray.get(self.scheduler.submit.remote(request), timeout=timeout_s)
        except BaseException:
            self._forget(request_id)
            raise
        if "rejected" in answer:
            self._forget(request_id)
            raise AdmissionRejected(answer["rejected"], answer["retry_after_s"])
        return Submitted(request_id, list(prompt), q, answer)

    def stream(self, prompt: str | list[int], params: SamplingParams, cache_salt: str | None = None,
               timeout_s: float = 120.0) -> Iterator[StreamEvent]:
        """Submit one request and yield its events as they arrive; aborts it if the caller stops early."""
        return self.events(self.submit(prompt, params, cache_salt), params, timeout_s)

    def events(self, submitted: Submitted, params: SamplingParams, timeout_s: float = 120.0) -> Iterator[StreamEvent]:
        """The events of a submitted request, in order; aborts it if the caller stops early."""
        request_id, prompt_ids, q = submitted.request_id, submitted.prompt_token_ids, submitted.queue
        samples = [_Sample(i, self._detokenizer(prompt_ids, params)) for i in range(params.n)]
        deadline = time.monotonic() + timeout_s
        try:
            while not all(s.result.status.is_finished() for s in samples):
                remaining = deadline - time.monotonic()
                try:
                    delta = q.get(timeout=max(remaining, 0.001))
                except queue.Empty:
                    raise TimeoutError(f"request {request_id} produced nothing for {timeout_s}s") from None
                yield from self._route(samples, delta)
        finally:
            if not all(s.result.status.is_finished() for s in samples) or _stopped_by_text(samples):
                self.scheduler.abort.remote(request_id)
            self._forget(request_id)

    def generate(self, prompts: list, params: SamplingParams | list[SamplingParams],
                 cache_salt: str | None = None, timeout_s: float = 300.0) -> list[list[SampleResult]]:
        """Submit every prompt at once; return each request's samples, in prompt order."""
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        submitted = [self.submit(p, sp, cache_salt) for p, sp in zip(prompts, params_list)]
        results = []
        for handle, sp in zip(submitted, params_list):
            by_index: dict[int, SampleResult] = {i: SampleResult(i) for i in range(sp.n)}
            for ev in self.events(handle, sp, timeout_s):
                r = by_index[ev.index]
                r.token_ids += ev.token_ids
                r.text += ev.text
                if ev.finished:
                    r.status = _status_of(ev.finish_reason)
                    r.error = ev.error
            results.append([by_index[i] for i in range(sp.n)])
        return results

    def _route(self, samples: list[_Sample], delta: TokenDelta) -> Iterator[StreamEvent]:
        targets = samples if delta.status == RequestStatus.FAILED else [samples[delta.index]]
        for s in targets:
            yield from s.feed(delta if len(targets) == 1 else TokenDelta(**{**asdict(delta), "index": s.result.index}))

    def _detokenizer(self, prompt_ids: list[int], params: SamplingParams) -> IncrementalDetokenizer | None:
        if self.tokenizer is None:
            return None
        return IncrementalDetokenizer(self.tokenizer, prompt_ids, params.stop, params.include_stop_str_in_output,
                                      params.skip_special_tokens)

    def _forget(self, request_id: str) -> None:
        with self._lock:
            self._queues.pop(request_id, None)


def _params_dict(params: SamplingParams) -> dict:
    return {k: v for k, v in vars(params).items()}


def _stopped_by_text(samples: list[_Sample]) -> bool:
    return any(s._detok is not None and s._detok.stop_hit is not None for s in samples)


def _status_of(finish_reason: str | None) -> RequestStatus:
    return {"stop": RequestStatus.FINISHED_STOPPED, "length": RequestStatus.FINISHED_LENGTH,
            "abort": RequestStatus.CANCELLED}.get(finish_reason, RequestStatus.FAILED)
