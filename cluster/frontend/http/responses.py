"""OpenAI response shapes for completions and chat, whole and streamed."""

from __future__ import annotations

import time


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def completion_logprobs(tokenizer, entries: list, text_start: int) -> dict:
    """The legacy completions logprobs object for [token_id, logprob, top] entries. As OpenAI's, each
    position's `top_logprobs` holds the `logprobs` most likely tokens and the sampled one (up to
    logprobs + 1 entries; `logprobs: 0` gives the sampled token alone)."""
    tokens, offsets, offset = [], [], text_start
    for token_id, _, _ in entries:
        piece = tokenizer.decode([token_id])
        tokens.append(piece)
        offsets.append(offset)
        offset += len(piece)
    return {
        "tokens": tokens,
        "token_logprobs": [lp for _, lp, _ in entries],
        "top_logprobs": [_with_sampled(tokenizer, token_id, lp, top) for token_id, lp, top in entries],
        "text_offset": offsets,
    }


def _with_sampled(tokenizer, token_id: int, logprob: float, top: list) -> dict:
    pieces = {tokenizer.decode([t]): lp for t, lp in top}
    pieces.setdefault(tokenizer.decode([token_id]), logprob)
    return pieces


def chat_logprobs(tokenizer, entries: list) -> dict:
    def item(token_id: int, logprob: float) -> dict:
        piece = tokenizer.decode([token_id])
        return {"token": piece, "logprob": logprob, "bytes": list(piece.encode())}

    return {"content": [{**item(t, lp), "top_logprobs": [item(i, l) for i, l in top]} for t, lp, top in entries]}


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
