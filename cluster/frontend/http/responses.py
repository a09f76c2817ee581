"""OpenAI response shapes for completions and chat, whole and streamed; how many logprob entries a
response may hold, and how a large one is built without stalling every other stream."""

from __future__ import annotations

import asyncio
import time
from typing import Callable

import msgspec
from fastapi.responses import Response

from cluster.frontend.http.protocol import ApiError

# A whole body with more logprob entries than this is built and encoded on a worker thread: 683k entries
# (33 MB) held this box's event loop ~10 s, which every other stream waited out. Below it, the thread's hop
# costs more than it saves.
OFF_LOOP_ENTRIES = 2_000


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def completion_logprobs(tokenizer, entries: list, text_start: int, as_ids: bool = False) -> dict:
    """The legacy completions logprobs object for [token_id, logprob, top] entries. As OpenAI's, each
    position's `top_logprobs` holds the `logprobs` most likely tokens and the sampled one (up to
    logprobs + 1 entries; `logprobs: 0` gives the sampled token alone). `as_ids` (vLLM's
    `return_tokens_as_token_ids`): tokens are named `token_id:N`; offsets stay those of the text."""
    tokens, offsets, offset = [], [], text_start
    for token_id, *_ in entries:
        piece = tokenizer.decode([token_id])
        tokens.append(_shown(tokenizer, token_id, as_ids))
        offsets.append(offset)
        offset += len(piece)
    return {
        "tokens": tokens,
        "token_logprobs": [lp for _, lp, *_ in entries],
        "top_logprobs": [None if top is None else _with_sampled(tokenizer, token_id, lp, top, as_ids)
                         for token_id, lp, top, *_ in entries],
        "text_offset": offsets,
    }


def _shown(tokenizer, token_id: int, as_ids: bool) -> str:
    """A token as logprobs name it: its text, or `token_id:N` (a client that needs the exact ids, since
    several tokens can decode to the same text)."""
    return f"token_id:{token_id}" if as_ids else tokenizer.decode([token_id])


def completion_choice(tokenizer, req, index: int, echo_text: str, prompt_ids, first, result) -> dict:
    """One choice of a whole completions response. `first`: sample 0's result (it carries the prompt's
    logprobs); with `req.scores_only`, the generated token is not shown."""
    entries = [] if req.scores_only else list(result.logprobs)
    if req.echo and req.logprobs is not None:
        entries = echoed_prompt_entries(prompt_ids, first.prompt_logprobs) + entries
    choice = {"index": index, "text": echo_text + ("" if req.scores_only else result.text),
              "logprobs": completion_logprobs(tokenizer, entries, 0 if req.echo else len(echo_text),
                                              req.return_tokens_as_token_ids) if req.logprobs is not None else None,
              "finish_reason": "length" if req.scores_only else result.finish_reason}
    if req.prompt_logprobs is not None:
        choice["prompt_logprobs"] = vllm_prompt_logprobs(tokenizer, first.prompt_logprobs)
    return choice


def echoed_prompt_entries(prompt_ids, prompt_logprobs: list | None) -> list:
    """The prompt's tokens as completion logprob entries (echo): [id, logprob, top], the first [id, None,
    None]; without scores (none were asked for or came), every logprob None."""
    entries = [[prompt_ids[0], None, None]]
    for i, token in enumerate(prompt_ids[1:], start=1):
        scored = prompt_logprobs[i] if prompt_logprobs and i < len(prompt_logprobs) else None
        entries.append(scored[:3] if scored else [token, None, None])
    return entries


def vllm_prompt_logprobs(tokenizer, prompt_logprobs: list | None) -> list | None:
    """vLLM's `prompt_logprobs` field: per prompt token None (the first) or {token id: {logprob, rank,
    decoded_token}} with the token itself and its top alternatives."""
    if prompt_logprobs is None:
        return None
    out: list = []
    for entry in prompt_logprobs:
        if entry is None:
            out.append(None)
            continue
        token, logprob, top, *rank = entry
        ranked = {t: (lp, r) for r, (t, lp) in enumerate(top, start=1)}
        ranked.setdefault(token, (logprob, rank[0] if rank else None))
        out.append({str(t): {"logprob": lp, "rank": r, "decoded_token": tokenizer.decode([t])}
                    for t, (lp, r) in ranked.items()})
    return out


def _with_sampled(tokenizer, token_id: int, logprob: float, top: list, as_ids: bool) -> dict:
    pieces = {_shown(tokenizer, t, as_ids): lp for t, lp in top}
    pieces.setdefault(_shown(tokenizer, token_id, as_ids), logprob)
    return pieces


def chat_logprobs(tokenizer, entries: list, as_ids: bool = False) -> dict:
    """`as_ids`: vLLM's `return_tokens_as_token_ids` (tokens named `token_id:N`, their bytes that name's)."""
    def item(token_id: int, logprob: float) -> dict:
        piece = _shown(tokenizer, token_id, as_ids)
        return {"token": piece, "logprob": logprob, "bytes": list(piece.encode())}

    return {"content": [{**item(t, lp), "top_logprobs": [item(i, l) for i, l in top]} for t, lp, top in entries]}


def chat_message(text: str, finish_reason: str | None, calls) -> tuple[dict, str | None]:
    """An assistant message and its finish reason; `calls` (a `tool_calls.CallReader`) when tools were
    offered."""
    if calls is None:
        return {"role": "assistant", "content": text}, finish_reason
    content, found = calls.parse(text)
    message = {"role": "assistant", "content": content}
    if not found:
        return message, finish_reason
    return {**message, "tool_calls": found}, tool_finish(finish_reason)


def tool_finish(finish_reason: str | None) -> str | None:
    """An answer that made calls finishes with "tool_calls", unless it was cut short (its calls too)."""
    return "tool_calls" if finish_reason == "stop" else finish_reason


def completion_body(request_id: str, model: str, choices: list[dict], usage_: dict | None) -> dict:
    body = {"id": request_id, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": choices}
    if usage_ is not None:
        body["usage"] = usage_
    return body


def chat_body(request_id: str, model: str, choices: list[dict], usage_: dict | None, chunk: bool) -> dict:
    body = {"id": request_id, "object": "chat.completion.chunk" if chunk else "chat.completion",
            "created": int(time.time()), "model": model, "choices": choices}
    if usage_ is not None:
        body["usage"] = usage_
    return body


def check_logprob_entries(limit: int, prompt_lengths: list[int], n: int, max_tokens: int, logprobs: int | None,
                          prompt_logprobs: int | None, echo_logprobs: bool) -> int:
    """How many logprob entries the response may hold, at most: (prompt tokens scored, once per way they are
    shown + prompts x max_tokens when generated tokens carry logprobs) x n x (1 + top logprobs). Each entry is
    ~100 bytes of JSON: a 175 KB request could ask for a 266 MB response. Past `limit`, a 400 naming the
    product, before anything is admitted. `logprobs`: the generated tokens' top (None: none); `prompt_logprobs`:
    vLLM's extra (None: none); `echo_logprobs`: echo shows the prompt with `logprobs` too."""
    views = [name for name, on in (("echo", echo_logprobs), ("prompt_logprobs", prompt_logprobs is not None)) if on]
    if not views and logprobs is None:
        return 0
    scored = sum(prompt_lengths) * len(views)
    generated = len(prompt_lengths) * max_tokens if logprobs is not None else 0
    top = max(logprobs or 0, prompt_logprobs or 0)
    entries = (scored + generated) * n * (1 + top)
    if entries > limit:
        parts = ([f"{scored:,} prompt tokens scored ({' and '.join(views)})"] if views else []) + \
                ([f"{len(prompt_lengths)} prompts x {max_tokens} max_tokens"] if generated else [])
        param = "prompt_logprobs" if prompt_logprobs is not None and prompt_logprobs >= (logprobs or 0) else "logprobs"
        raise ApiError(400, f"this response would hold ({' + '.join(parts)}) x n {n} x (1 + {top} top logprobs) = "
                            f"{entries:,} logprob entries; at most {limit:,} per request "
                            "(ingress.max_response_logprobs): ask for fewer prompts, tokens, n or top logprobs", param)
    return entries


async def json_response(build: Callable[[], dict], entries: int) -> dict | Response:
    """The body `build` makes: as is when small, else built and encoded on a worker thread, so that the event
    loop (every other stream) only waits for the GIL's switch interval, not for the whole body. msgspec
    encodes it (~10x json's speed: the encode holds the GIL throughout) and writes NaN or infinity as null."""
    if entries <= OFF_LOOP_ENTRIES:
        return build()
    encoded = await asyncio.to_thread(lambda: msgspec.json.encode(build()))
    return Response(encoded, media_type="application/json")


class PieceCache:
    """A tokenizer whose one-token decodes are remembered for one response: an echo with top logprobs names
    the same few thousand tokens millions of times, and each decode costs microseconds."""

    def __init__(self, tokenizer):
        self._tokenizer, self._pieces = tokenizer, {}

    def decode(self, ids, **kwargs) -> str:
        if len(ids) != 1 or kwargs:
            return self._tokenizer.decode(ids, **kwargs)
        piece = self._pieces.get(ids[0])
        if piece is None:
            piece = self._pieces[ids[0]] = self._tokenizer.decode(ids)
        return piece
