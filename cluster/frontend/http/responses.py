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
