"""Server-sent event streams of the ingress: completions and chat chunks, several prompts merged."""

from __future__ import annotations

import asyncio
import json
import logging
from typing import TYPE_CHECKING, AsyncIterator

import msgspec
from fastapi.responses import StreamingResponse

from cluster.frontend.http import responses
from cluster.frontend.http.protocol import ApiError, ChatCompletionRequest, CompletionRequest
from cluster.frontend.request_stream import RequestStream

if TYPE_CHECKING:
    from cluster.frontend.http.ingress import Ingress

log = logging.getLogger("tandem.ingress")


def sse(chunks: AsyncIterator[dict | bytes], on_close) -> StreamingResponse:
    """Server-sent events; `on_close` runs however the stream ends (done, error, client gone). A chunk is a
    body to encode, or an event encoded already (`encoded_event`). A failure after the 200 went out cannot
    change the status: it ends the stream with an error event (the OpenAI envelope), then [DONE], never a
    cut-off connection."""
    async def body():
        try:
            async for chunk in chunks:
                yield chunk if isinstance(chunk, bytes) else f"data: {json.dumps(chunk)}\n\n".encode()
        except Exception as exc:  # noqa: BLE001 (a bug: logged, told to the client in the stream)
            log.exception("a stream failed after it started")
            error = ApiError(500, f"internal error while streaming ({type(exc).__name__})", None, "server_error")
            yield f"data: {json.dumps(error.body())}\n\n".encode()
        finally:
            on_close()
        yield b"data: [DONE]\n\n"

    return StreamingResponse(body(), media_type="text/event-stream")


async def encoded_event(build, entries: int) -> dict | bytes:
    """The chunk `build` makes: as is when small, else built and encoded on a worker thread (as a whole
    body, responses.json_response), so a streamed echo of a long prompt's logprobs stalls no other stream."""
    if entries <= responses.OFF_LOOP_ENTRIES:
        return build()
    return await asyncio.to_thread(lambda: b"data: " + msgspec.json.encode(build()) + b"\n\n")


async def _merge(gens: list[AsyncIterator]) -> AsyncIterator[tuple[int, object]]:
    """Interleave several async iterators as items arrive; cancelling the merge cancels them all."""
    q: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i, gen):
        try:
            async for item in gen:
                await q.put((i, item))
        finally:
            await q.put((i, done))

    tasks = [asyncio.create_task(pump(i, g)) for i, g in enumerate(gens)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await q.get()
            if item is done:
                remaining -= 1
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()


async def completion_chunks(ingress: Ingress, opened, rid: str, req: CompletionRequest, echo_texts: list[str],
                             arrival: float) -> AsyncIterator[dict]:
    model = ingress.model.name
    offsets: dict[int, int] = {}
    prompt_total = sum(len(stream.prompt_token_ids) for stream in opened)
    echoed: set[int] = set()
    async for i, ev in _merge([ingress.events(stream, arrival) for stream in opened]):
        index = i * req.n + ev.index
        if req.echo and index not in echoed:
            # The prompt goes out with the first token (when its logprobs, computed in prefill, exist too).
            echoed.add(index)
            stream = opened[i]

            def echo_chunk() -> dict:
                lp = None
                if req.logprobs is not None:
                    entries = responses.echoed_prompt_entries(stream.prompt_token_ids, stream.results[0].prompt_logprobs)
                    lp = responses.completion_logprobs(responses.PieceCache(ingress.model.tokenizer), entries, 0,
                                                       req.return_tokens_as_token_ids)
                return responses.completion_body(rid, model, [{"index": index, "text": echo_texts[i], "logprobs": lp,
                                                               "finish_reason": None}], None)
            scored = len(stream.prompt_token_ids) * (1 + req.logprobs) if req.logprobs is not None else 0
            yield await encoded_event(echo_chunk, scored)
        if req.scores_only:
            if ev.finished:
                yield responses.completion_body(rid, model, [{"index": index, "text": "", "logprobs": None,
                                                              "finish_reason": "length"}], None)
            continue
        lp = None
        if req.logprobs is not None and ev.logprobs:
            lp = responses.completion_logprobs(ingress.model.tokenizer, ev.logprobs, offsets.get(index, len(echo_texts[i])),
                                               req.return_tokens_as_token_ids)
            if lp["tokens"]:
                offsets[index] = lp["text_offset"][-1] + len(ingress.model.tokenizer.decode([ev.logprobs[-1][0]]))
        yield responses.completion_body(rid, model, [{"index": index, "text": ev.text, "logprobs": lp,
                                                      "finish_reason": ev.finish_reason if ev.finished else None}],
                                        _running_usage(ingress, req, prompt_total, opened))
    if _usage_wanted(req):
        completion = 0 if req.scores_only else sum(len(r.token_ids) for stream in opened for r in stream.results)
        cached = sum(stream.results[0].num_cached_tokens for stream in opened)
        prompt = sum(len(stream.prompt_token_ids) for stream in opened)
        yield responses.completion_body(rid, model, [], ingress.usage(prompt, completion, cached))


async def chat_chunks(ingress: Ingress, stream: RequestStream, rid: str, req: ChatCompletionRequest,
                       arrival: float, calls=None) -> AsyncIterator[dict]:
    """`calls` (a `tool_calls.CallReader`): tools were offered, so each choice's text goes through its own
    call reader: content as it is decoded (held back only while it could start a call), calls as OpenAI's
    `tool_calls` deltas."""
    model = ingress.model.name
    started: set[int] = set()  # choices whose role went out: with their first token, as vLLM sends it
    readers: dict = {}
    prompt = len(stream.prompt_token_ids)
    async for ev in ingress.events(stream, arrival):
        lp = responses.chat_logprobs(ingress.model.tokenizer, ev.logprobs, req.return_tokens_as_token_ids) \
            if req.logprobs and ev.logprobs else None
        finish = ev.finish_reason if ev.finished else None
        if calls is None:
            delta = {"content": ev.text} if ev.text or not ev.finished else {}
            first = {"role": "assistant", "content": ev.text}
        else:
            reader = readers.get(ev.index) or readers.setdefault(ev.index, calls.stream())
            delta = reader.feed(ev.text, last=ev.finished) or {}
            first = {"role": "assistant", **delta}
            if reader.calls:
                finish = responses.tool_finish(finish)
            if not (delta or lp or ev.finished or ev.index not in started):
                continue  # all of it held back: it may start a call
        if ev.index not in started:
            started.add(ev.index)
            delta = first
        yield responses.chat_body(rid, model, [{"index": ev.index, "delta": delta, "logprobs": lp,
                                                "finish_reason": finish}],
                                  _running_usage(ingress, req, prompt, [stream]), chunk=True)
    if _usage_wanted(req):
        completion = sum(len(r.token_ids) for r in stream.results)
        yield responses.chat_body(rid, model, [], ingress.usage(prompt, completion, stream.results[0].num_cached_tokens),
                                  chunk=True)


def _usage_wanted(req) -> bool:
    return bool(req.stream_options and req.stream_options.include_usage)


def _running_usage(ingress: Ingress, req, prompt_tokens: int, streams: list[RequestStream]) -> dict | None:
    """vLLM's `stream_options.continuous_usage_stats`: every chunk carries the usage so far."""
    if not (_usage_wanted(req) and req.stream_options.continuous_usage_stats):
        return None
    completion = sum(len(r.token_ids) for s in streams for r in s.results)
    cached = sum(s.results[0].num_cached_tokens for s in streams if s.results)
    return ingress.usage(prompt_tokens, completion, cached)
