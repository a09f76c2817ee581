"""A chat request made ready to run: its checks, its tools, its structured output, the conversation
through the chat template, and its sampling parameters. Chat completions and the Responses API (which
is turned into a chat request) share it."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass

from actors.protocol.sampling_params import SamplingParams
from cluster.frontend.http import tool_calls
from cluster.frontend.http.chat_template import TemplateOptions
from cluster.frontend.http.ingress import Ingress
from cluster.frontend.http.served_model import check_text
from cluster.frontend.http.protocol import ApiError, ChatCompletionRequest


@dataclass
class PreparedChat:
    prompt: list[int]
    params: SamplingParams
    calls: tool_calls.CallReader | None  # tools were offered: how an answer is read for calls


def _text_content(message: dict) -> dict:
    """Content given as parts ([{"type": "text", "text": ...}], as vLLM's benchmark and many clients send it)
    becomes one string, the parts joined by a newline as vLLM joins them."""
    content = message.get("content")
    if not isinstance(content, list):
        return message
    if any(not isinstance(p, dict) or p.get("type") != "text" or not isinstance(p.get("text"), str) for p in content):
        kinds = sorted({str(p.get("type")) if isinstance(p, dict) else type(p).__name__ for p in content})
        raise ApiError(400, f"messages: only text content parts are served (got {', '.join(kinds)})", "messages")
    return {**message, "content": "\n".join(p["text"] for p in content)}


# Request fields that are chat template variables: the template decides what they do (gpt-oss's writes the
# reasoning effort into its system turn); a template that never reads one would drop it silently.
TEMPLATE_FIELDS = ("reasoning_effort", "verbosity")


def _template_kwargs(req: ChatCompletionRequest, variables: frozenset[str] | None) -> dict:
    kwargs = dict(req.chat_template_kwargs or {})
    for name in TEMPLATE_FIELDS:
        value = getattr(req, name)
        if value is None:
            continue
        if name in kwargs:
            raise ApiError(400, f"{name} is set twice (also in chat_template_kwargs)", name)
        if variables is not None and name not in variables:
            raise ApiError(400, f"{name} is not supported by this model's chat template (a variable it never "
                                "reads; a template that does, such as gpt-oss's, takes it)", name)
        kwargs[name] = value
    return kwargs


async def prepare_chat(ingress: Ingress, req: ChatCompletionRequest) -> PreparedChat:
    asked_param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    max_tokens = ingress.model.check_common(req, getattr(req, asked_param))
    if req.top_logprobs is not None and not 0 <= req.top_logprobs <= 20:
        raise ApiError(400, "top_logprobs must be between 0 and 20", "top_logprobs")
    if req.top_logprobs and not req.logprobs:
        raise ApiError(400, "top_logprobs needs logprobs: true", "top_logprobs")
    tools, forced = tool_calls.plan(req, ingress.model.tool_call_parser)
    structured = await ingress.model.structured_output(req)
    if forced is not None:
        if structured is not None:
            raise ApiError(400, "tool_choice required or named cannot be combined with a structured output",
                           "tool_choice")
        structured = await ingress.model.check_structured(forced, "tools")
    messages = tool_calls.template_messages([_text_content(m.model_dump()) for m in req.messages])
    check_text(json.dumps([messages, req.chat_template_kwargs], ensure_ascii=False), "messages")
    options = TemplateOptions(req.add_generation_prompt, req.continue_final_message,
                              _template_kwargs(req, ingress.model.template_variables), bool(req.add_special_tokens))
    prompt = await asyncio.to_thread(ingress.model.chat_prompt, messages, tools, options)
    prompt = ingress.model.truncated(prompt, req.truncate_prompt_tokens)
    ingress.model.check_prompt(prompt, "messages")
    max_tokens = ingress.model.fit_max_tokens(max_tokens, len(prompt), asked_param)
    params = req.sampling_params(max_tokens, (req.top_logprobs or 0) if req.logprobs else None, req.prompt_logprobs,
                                 structured)
    calls = tool_calls.CallReader(ingress.model.tool_call_parser, forced is not None, req.parallel_tool_calls is False) \
        if tools else None
    return PreparedChat(prompt, params, calls)
