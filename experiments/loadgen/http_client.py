"""One streaming `/v1/completions` request, timed from its scheduled arrival, as a `RequestRecord`.

Times are seconds on `time.perf_counter()` relative to the run's start `t0`. A chunk's emit time is
when its bytes arrived, so several events in one read share a time, as they did on the wire.
Failures are values, not exceptions: the error kind is one of http_<status>, timeout, connection,
stream_error.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import httpx

from experiments.loadgen.workload import RequestSpec


@dataclass
class RequestRecord:
    index: int
    warmup: bool
    prompt_len: int | None
    max_tokens: int
    scheduled: float
    sent: float | None = None
    emits: list[float] = field(default_factory=list)
    end: float | None = None
    prompt_tokens: int | None = None  # from the server's usage
    output_tokens: int | None = None
    cached_tokens: int | None = None  # prompt tokens the server's prefix cache served, if it says
    error: str | None = None
    error_detail: str | None = None
    failed_at: float | None = None  # when the client learnt it failed (a refusal's answer, say)

    @property
    def ok(self) -> bool:
        return self.error is None and self.end is not None

    @property
    def ttft(self) -> float | None:
        return self.emits[0] - self.scheduled if self.ok and self.emits else None

    @property
    def e2e(self) -> float | None:
        return self.end - self.scheduled if self.ok else None

    @property
    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.emits, self.emits[1:])] if self.ok else []

    @property
    def tpot(self) -> float | None:
        """(last emit - first emit) / (N - 1), N the output tokens the server reported (else the emits)."""
        n = self.output_tokens or len(self.emits)
        return (self.emits[-1] - self.emits[0]) / (n - 1) if self.ok and n > 1 and self.emits else None

    @property
    def lag(self) -> float | None:
        """How late the client itself sent the request: the load generator's own bottleneck."""
        return self.sent - self.scheduled if self.sent is not None else None


class StreamError(Exception):
    pass


async def sse_events(response: httpx.Response, t0: float) -> AsyncIterator[tuple[float, str]]:
    """(arrival time, data) of each server-sent event; comments and non-data fields are skipped."""
    buffer = b""
    async for chunk in response.aiter_bytes():
        now = time.perf_counter() - t0
        buffer += chunk.replace(b"\r\n", b"\n")
        *events, buffer = buffer.split(b"\n\n")
        for event in events:
            data = [line[5:].removeprefix(b" ") for line in event.split(b"\n") if line.startswith(b"data:")]
            if data:
                yield now, b"\n".join(data).decode()
    if buffer.strip():
        raise StreamError("the stream ended inside an event")


def request_body(model: str, req: RequestSpec, temperature: float) -> dict:
    # ignore_eos is an extra field tandem and vLLM accept, so the output length is what the workload says.
    return {"model": model, "prompt": req.prompt, "max_tokens": req.output_len, "temperature": temperature,
            "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}


async def send_request(client: httpx.AsyncClient, body: dict, record: RequestRecord, t0: float,
                       timeout_s: float) -> RequestRecord:
    """Send now, fill `record` in place; the timeout counts from the scheduled arrival."""
    record.sent = time.perf_counter() - t0
    remaining = record.scheduled + timeout_s - record.sent
    try:
        await asyncio.wait_for(_stream(client, body, record, t0), max(remaining, 0.0))
    except (asyncio.TimeoutError, httpx.TimeoutException) as exc:
        _fail(record, "connection" if isinstance(exc, httpx.ConnectTimeout) else "timeout", f"after {timeout_s:g} s")
    except httpx.ConnectError as exc:
        _fail(record, "connection", str(exc) or type(exc).__name__)
    except httpx.TransportError as exc:
        _fail(record, "stream_error" if record.emits else "connection", f"{type(exc).__name__}: {exc}")
    except StreamError as exc:
        _fail(record, "stream_error", str(exc))
    return record


def _fail(record: RequestRecord, kind: str, detail: str) -> None:
    record.error, record.error_detail, record.end = kind, detail[:300], None


async def _stream(client: httpx.AsyncClient, body: dict, record: RequestRecord, t0: float) -> None:
    async with client.stream("POST", "/v1/completions", json=body) as response:
        if response.status_code != 200:
            text = (await response.aread()).decode(errors="replace")
            _fail(record, f"http_{response.status_code}", text)
            record.failed_at = time.perf_counter() - t0
            return
        done = False
        async for now, data in sse_events(response, t0):
            if done:
                raise StreamError("data after [DONE]")
            if data == "[DONE]":
                done = True
                continue
            _on_chunk(_parse(data), now, record)
        if not done:
            raise StreamError("the stream ended without [DONE]")
        if not record.emits:
            raise StreamError("the stream carried no tokens")
        record.end = record.emits[-1]


def _parse(data: str) -> dict:
    try:
        chunk = json.loads(data)
    except json.JSONDecodeError:
        raise StreamError(f"not JSON: {data[:80]!r}") from None
    if not isinstance(chunk, dict):
        raise StreamError(f"not a JSON object: {data[:80]!r}")
    if "error" in chunk:
        raise StreamError(f"error event: {json.dumps(chunk['error'])[:200]}")
    return chunk


def _on_chunk(chunk: dict, now: float, record: RequestRecord) -> None:
    for choice in chunk.get("choices") or []:
        # A finish marker with no text carries no token; everything else is a token emit (the text
        # of a token can be empty while the detokenizer waits for the rest of a character).
        if choice.get("text") or choice.get("finish_reason") is None:
            record.emits.append(now)
    usage = chunk.get("usage")
    if usage:
        record.prompt_tokens = usage.get("prompt_tokens")
        record.output_tokens = usage.get("completion_tokens")
        record.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")


async def fetch_model(client: httpx.AsyncClient) -> str:
    """The first model the server lists at /v1/models."""
    try:
        response = await client.get("/v1/models", timeout=10.0)
    except httpx.HTTPError as exc:
        raise ValueError(f"cannot reach {client.base_url}/v1/models: {type(exc).__name__} {exc}") from None
    if response.status_code != 200:
        raise ValueError(f"{client.base_url}/v1/models answered HTTP {response.status_code}; pass --model")
    models = response.json().get("data") or []
    if not models:
        raise ValueError(f"{client.base_url}/v1/models lists no model; pass --model")
    return models[0]["id"]
