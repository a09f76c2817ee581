"""OpenAI request bodies (pydantic) and their translation into tandem's SamplingParams.

Bad input raises `ApiError` (HTTP 400) naming the parameter, never a 5xx.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import json

from pydantic import BaseModel, ConfigDict, Field

from actors.protocol.sampling_params import SamplingParams
from actors.protocol.structured_output import StructuredOutput


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error",
                 headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.status}}


@dataclass(frozen=True)
class RequestCaps:
    """Per-request caps and defaults of the ingress (config `ingress`): one request cannot crowd out the
    others, and a field the server does not know is refused (or, accepted, logged: fields.py)."""

    max_n: int = 16
    max_prompts: int = 64  # prompts in one /v1/completions request
    max_sequences: int = 256  # n x prompts
    max_stop_strings: int = 16
    max_stop_chars: int = 256
    max_logit_bias: int = 1024
    default_max_tokens: int = 1024  # a chat request that sets none (bounded by the rest of the context)
    accept_unknown_fields: bool = False
    max_allowed_token_ids: int = 4096
    max_response_logprobs: int = 1_000_000  # (scored prompt tokens + generated) x n x (1 + top): responses.py


# What the OpenAPI document says of the request and parameter objects below: no other field (they keep
# undeclared ones only so that fields.check_fields can refuse them by name, or log them when
# `ingress.unknown_fields: accept`).
CLOSED_SCHEMA = {"additionalProperties": False}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow", json_schema_extra=CLOSED_SCHEMA)
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: every chunk carries the usage so far


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="allow", populate_by_name=True, json_schema_extra=CLOSED_SCHEMA)
    name: str = "response"
    description: str | None = None  # OpenAI's hint to the model (LangChain sends a schema's docstring): the grammar is the schema
    schema_: dict = Field(alias="schema")
    strict: bool | None = None  # the schema is always enforced


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="allow", json_schema_extra=CLOSED_SCHEMA)
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class _Common(BaseModel):
    # Undeclared fields are kept so that fields.check_fields can refuse them by name (or log them): none is
    # dropped silently. No float may be Infinity or NaN (JSON has neither; Python's parser accepts both).
    model_config = ConfigDict(extra="allow", allow_inf_nan=False, json_schema_extra=CLOSED_SCHEMA)

    model: str
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    typical_p: float | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # who the request is for and how to admit and route it (request_hints.py)
    safety_identifier: str | None = Field(None, max_length=64)
    metadata: dict[str, str] | None = None
    service_tier: Literal["auto", "default", "flex", "priority"] | None = None
    priority: int = 0  # vLLM's: the admission order among waiting requests, lower first
    prompt_cache_key: str | None = Field(None, max_length=256)
    ignore_eos: bool = False
    min_tokens: int = 0
    timeout: float | None = Field(None, gt=0, description="seconds before the request ends as timed out; it can "
                                   "only shorten the server's own deadline")
    best_of: int | None = None
    # vLLM's extras
    allowed_token_ids: list[int] | None = None  # the only tokens that may be sampled
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    truncate_prompt_tokens: int | None = Field(None, ge=-1, description="keep the last N prompt tokens (after the "
                                               "chat template); -1: the model's context")
    add_special_tokens: bool | None = None  # the tokenizer's own (BOS); None: completions add them, chat does not
    return_tokens_as_token_ids: bool = False  # logprobs name their tokens "token_id:N"
    # Structured output: OpenAI's response_format, vLLM's guided_* extras and its newer structured_outputs.
    response_format: ResponseFormat | None = None
    guided_json: dict | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: dict | None = None

    def structured_output(self) -> tuple[StructuredOutput, str] | None:
        """What the output must match, and the parameter that asked for it; a 400 for two at once."""
        asked = []
        rf = self.response_format
        if rf is not None and rf.type == "json_object":
            asked.append((StructuredOutput("json_object"), "response_format"))
        elif rf is not None and rf.type == "json_schema":
            if rf.json_schema is None:
                raise ApiError(400, "response_format json_schema needs a json_schema with a schema", "response_format")
            asked.append((StructuredOutput("json_schema", json.dumps(rf.json_schema.schema_)), "response_format"))
        extras = {f"guided_{k}": getattr(self, f"guided_{k}") for k in ("json", "regex", "choice", "grammar")}
        for key, value in (self.structured_outputs or {}).items():  # vLLM >= 0.10's spelling of the same
            if key in ("json", "regex", "choice", "grammar") and value is not None:
                extras[f"structured_outputs.{key}"] = value
            elif key == "json_object" and value:
                asked.append((StructuredOutput("json_object"), "structured_outputs.json_object"))
            elif key not in ("json", "regex", "choice", "grammar", "json_object") and value:
                raise ApiError(400, f"structured_outputs.{key} is not supported by this server",
                               f"structured_outputs.{key}")
        for name, value in extras.items():
            if value is None:
                continue
            kind = name.rsplit("_", 1)[-1].rsplit(".", 1)[-1]
            try:
                spec = _spec_text(kind, value)
            except (TypeError, ValueError) as exc:
                raise ApiError(400, f"{name}: {exc}", name) from None
            asked.append((StructuredOutput("json_schema" if kind == "json" else kind, spec), name))
        if len(asked) > 1:
            raise ApiError(400, f"give one structured output, not {', '.join(n for _, n in asked)}", asked[1][1])
        return asked[0] if asked else None

    def check_limits(self, limits: RequestCaps) -> None:
        """What one request may ask for, beyond what a valid one needs (each a 400 naming the field)."""
        if self.best_of is not None and self.best_of != self.n and self.best_of > 1:
            raise ApiError(400, "best_of > 1 is not supported; use n", "best_of")
        stop = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        if len(stop) > limits.max_stop_strings:
            raise ApiError(400, f"stop has {len(stop)} strings; at most {limits.max_stop_strings} are allowed", "stop")
        if any(len(s) > limits.max_stop_chars for s in stop):
            raise ApiError(400, f"every stop string must be at most {limits.max_stop_chars} characters", "stop")
        # Every list-valued sampling field is capped here, before any of it is looked at (the engine walks
        # them per request, some per step): stop, stop_token_ids, logit_bias, allowed_token_ids.
        for name, count, cap, key in (
            ("stop_token_ids", len(self.stop_token_ids or ()), limits.max_stop_strings, "max_stop_strings"),
            ("logit_bias", len(self.logit_bias or {}), limits.max_logit_bias, "max_logit_bias"),
            ("allowed_token_ids", len(self.allowed_token_ids or ()), limits.max_allowed_token_ids,
             "max_allowed_token_ids"),
        ):
            if count > cap:
                raise ApiError(400, f"{name} has {count} entries; at most {cap} are allowed (ingress.{key})", name)

    def sampling_params(self, max_tokens: int, logprobs: int | None, prompt_logprobs: int | None = None,
                        structured: StructuredOutput | None = None) -> SamplingParams:
        bias = None
        if self.logit_bias:
            try:
                bias = {int(k): v for k, v in self.logit_bias.items()}
            except ValueError:
                raise ApiError(400, "logit_bias keys must be token ids", "logit_bias") from None
        stop = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        values = dict(
            n=self.n, max_tokens=max_tokens, min_tokens=self.min_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=None if self.top_k in (None, -1, 0) else self.top_k,
            min_p=self.min_p or 0.0, typical_p=1.0 if self.typical_p is None else self.typical_p,
            repetition_penalty=self.repetition_penalty or 1.0,
            frequency_penalty=self.frequency_penalty or 0.0, presence_penalty=self.presence_penalty or 0.0,
            logit_bias=bias, seed=self.seed, stop=tuple(stop), stop_token_ids=tuple(self.stop_token_ids or ()),
            ignore_eos=self.ignore_eos, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
            structured_output=structured, include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens,
            allowed_token_ids=None if self.allowed_token_ids is None else tuple(self.allowed_token_ids),
        )
        try:
            return SamplingParams(**values)
        except ValueError as exc:
            raise ApiError(400, str(exc), _param_of(str(exc))) from None


class CompletionRequest(_Common):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16  # 0 with echo: score the prompt only
    logprobs: int | None = None
    echo: bool = False
    prompt_logprobs: int | None = None  # vLLM's extra

    @property
    def scores_only(self) -> bool:
        return self.echo and self.max_tokens == 0

    def wanted_prompt_logprobs(self) -> int | None:
        """How many top alternatives each prompt token's logprob needs (None: no prompt logprobs)."""
        wanted = [k for k in (self.prompt_logprobs, self.logprobs if self.echo else None) if k is not None]
        return max(wanted) if wanted else None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # every key reaches the chat template, as in vLLM
    role: Literal["system", "developer", "user", "assistant", "tool"]  # developer: OpenAI's newer name for system
    content: str | list[dict] | None = None
    tool_calls: list[dict] | None = None  # an assistant's calls, passed back in the conversation
    tool_call_id: str | None = None  # a tool message: the call it answers
    name: str | None = None


class FunctionDef(BaseModel):
    model_config = ConfigDict(extra="allow")  # a tool definition reaches the chat template whole
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    parameters: dict | None = None  # a JSON schema of the arguments
    strict: bool | None = None


class ToolDef(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["function"] = "function"
    function: FunctionDef


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    prompt_logprobs: int | None = None  # vLLM's extra
    tools: list[ToolDef] | None = Field(None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | dict | None = None
    parallel_tool_calls: bool | None = None  # false: at most one call is read back from the answer
    store: bool | None = None  # kept for GET /v1/chat/completions/{id} (response_store.py), streamed ones too
    # variables of the chat template, where it reads them (gpt-oss's does): a 400 naming them otherwise
    reasoning_effort: Literal["minimal", "low", "medium", "high"] | None = None
    verbosity: Literal["low", "medium", "high"] | None = None
    # vLLM's template extras (chat_template.py)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict | None = None


def _spec_text(kind: str, value) -> str:
    """A guided_* value as StructuredOutput's spec text."""
    if kind == "json":
        if isinstance(value, str):
            value = json.loads(value)
        if not isinstance(value, dict):
            raise ValueError("must be a JSON schema object")
        return json.dumps(value)
    if kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
            raise ValueError("must be a non-empty list of non-empty strings")
        return json.dumps(value)
    if not isinstance(value, str) or not value:
        raise ValueError("must be a non-empty string")
    return value


def _param_of(message: str) -> str | None:
    # SamplingParams errors read "invalid sampling parameter NAME=..." or "...parameter NAME: ..."
    marker = "invalid sampling parameter "
    if marker in message:
        rest = message.split(marker, 1)[1]
        return rest.split("=", 1)[0].split(":", 1)[0].strip()
    return None
