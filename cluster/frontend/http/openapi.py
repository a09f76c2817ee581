"""Response schemas for the OpenAPI document: what clients (and the fuzz test) may rely on.

The handlers build plain dicts (`responses.py`); these models only describe them, so the served
`/openapi.json` states every status code and body shape the server can answer with.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: int


class ErrorBody(BaseModel):
    error: ErrorDetail


class PromptTokensDetails(BaseModel):
    cached_tokens: int


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: Literal["stop", "length", "abort", "error"] | None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TokenLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(TokenLogprob):
    top_logprobs: list[TokenLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob]


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: str


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: Literal["stop", "length", "abort", "error"] | None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None


class ChatDelta(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None
    finish_reason: Literal["stop", "length", "abort", "error"] | None


class ChatCompletionChunk(BaseModel):
    """One `data:` event of a streamed chat completion (a streamed completion's events are
    `CompletionResponse`s: the same shape, a piece of text at a time)."""

    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None


class DetokenizeResponse(BaseModel):
    prompt: str


class VersionResponse(BaseModel):
    version: str


class ResponseOutputText(BaseModel):
    type: Literal["output_text"]
    text: str
    annotations: list


class ResponseMessage(BaseModel):
    type: Literal["message"]
    id: str
    status: Literal["in_progress", "completed"]
    role: Literal["assistant"]
    content: list[ResponseOutputText]


class ResponseUsage(BaseModel):
    input_tokens: int
    output_tokens: int
    total_tokens: int


class ResponseObject(BaseModel):
    """A /v1/responses body (and the `response` of its first and last stream events)."""

    id: str
    object: Literal["response"]
    created_at: int
    status: Literal["in_progress", "completed", "incomplete", "failed"]
    model: str
    output: list[ResponseMessage]
    output_text: str
    usage: ResponseUsage | None


class ResponseStreamEvent(BaseModel):
    """One event of a streamed /v1/responses answer; the fields beside these depend on its type."""

    model_config = ConfigDict(extra="allow")
    type: Literal["response.created", "response.output_item.added", "response.content_part.added",
                  "response.output_text.delta", "response.output_text.done", "response.content_part.done",
                  "response.output_item.done", "response.completed", "response.incomplete", "response.failed"]
    sequence_number: int
    response: ResponseObject | None = None
    item: ResponseMessage | None = None


class TokenizerInfoResponse(BaseModel):
    tokenizer_class: str
    eos_token: str | None
    bos_token: str | None
    pad_token: str | None
    chat_template: str | None
    model_max_length: int


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


def documented(ok_model: type[BaseModel] | None, *errors: int, streams: bool = False) -> dict:
    """FastAPI `responses=` for a route: its 200 body (JSON, or SSE too) and its error statuses."""
    ok: dict = {"description": "OK"}
    if ok_model is not None:
        ok["model"] = ok_model
    if streams:
        ok["content"] = {"text/event-stream": {"schema": {"type": "string"}}}
    out: dict = {200: ok}
    for status in errors:
        out[status] = {"model": ErrorBody, "description": "error"}
    return out
