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


class DeletedResponse(BaseModel):
    id: str
    object: Literal["response"]
    deleted: bool


class HealthBody(BaseModel):
    status: Literal["ok", "unhealthy"]
    reason: str | None = None


class ReadyBody(BaseModel):
    ready: bool
    workers: list[str]


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


# What each error status means here, as the served document says it (docs/reference/http-api.md is made from it).
ERROR_MEANINGS = {
    400: "a bad request: the error's `param` names the field (or the prompt, or max_tokens that does not fit)",
    401: "no API key, or one `ingress.api_keys` does not hold (or, on /admin, not the admin key)",
    404: "an unknown model, or no stored object with that id (for this tenant)",
    408: "the body did not arrive within `ingress.body_timeout_s`, or the request ran past its own `timeout`",
    413: "a body over `ingress.max_body_bytes`",
    429: "turned away (Retry-After): the requests waiting would not be admitted within `scheduler.queue_timeout_s`, "
         "no decode worker had room within it, or the tenant's rate, token or concurrency limit",
    500: "the request failed inside the cluster, or an internal error (logged)",
    503: "unavailable (Retry-After): no admission answer within `scheduler.progress_timeout_s`, the scheduler "
         "lost while admitting, or no worker in a pool",
    504: "the request ran past `ingress.request_timeout_s`",
}


def documented(ok_model: type[BaseModel] | None, *errors: int, streams: bool = False) -> dict:
    """FastAPI `responses=` for a route: its 200 body (JSON, or SSE too) and its error statuses."""
    ok: dict = {"description": "OK" + (": JSON, or server-sent events with `stream: true`" if streams else "")}
    if ok_model is not None:
        ok["model"] = ok_model
    if streams:
        ok["content"] = {"text/event-stream": {"schema": {"type": "string"}}}
    out: dict = {200: ok}
    for status in errors:
        out[status] = {"model": ErrorBody, "description": ERROR_MEANINGS[status]}
    return out


def without_validation_answers(app) -> None:
    """FastAPI documents a 422 on every route with parameters; this server answers a request that fails its
    model with a 400 naming the field (app.py), so the served document says that and only that."""
    generate = app.openapi

    def openapi() -> dict:
        if app.openapi_schema is None:
            document = generate()  # caches itself on the app; trimmed here once
            for operations in document["paths"].values():
                for operation in operations.values():
                    operation["responses"].pop("422", None)
            for name in ("HTTPValidationError", "ValidationError"):
                document.get("components", {}).get("schemas", {}).pop(name, None)
        return app.openapi_schema

    app.openapi = openapi
