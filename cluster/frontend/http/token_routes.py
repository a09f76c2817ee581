"""vLLM's utility routes beside the OpenAI API: `/tokenize`, `/detokenize`, `/tokenizer_info` and
`/version`. Clients use them to count tokens against the context (`max_model_len`), to map ids back to
text, and (lm-eval's remote tokenizer) to tokenize exactly as the server does."""

from __future__ import annotations

import asyncio
import importlib.metadata
import json

from fastapi import FastAPI, Request
from pydantic import BaseModel, ConfigDict, Field

from cluster.frontend.http.chat_template import TemplateOptions
from cluster.frontend.http.fields import check_fields
from cluster.frontend.http.ingress import Ingress
from cluster.frontend.http.served_model import check_text
from cluster.frontend.http.openapi import (
    DetokenizeResponse, TokenizeResponse, TokenizerInfoResponse, VersionResponse, documented,
)
from cluster.frontend.http.protocol import CLOSED_SCHEMA, ApiError, ChatMessage
from cluster.frontend.http.body_guard import tenant_of


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="allow", json_schema_extra=CLOSED_SCHEMA)  # undeclared: refused or logged (fields.py)
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None  # through the chat template, as chat completions would
    add_special_tokens: bool | None = None  # None: a prompt gets them, messages do not (their template writes them)
    # with messages, as in chat completions (chat_template.py)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict | None = None


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="allow", json_schema_extra=CLOSED_SCHEMA)
    model: str | None = None
    tokens: list[int] = Field(max_length=1 << 20)


def add_token_routes(app: FastAPI, ingress: Ingress) -> None:
    @app.post("/tokenize", response_model=None, responses=documented(TokenizeResponse, 400, 401, 404, 413))
    async def tokenize(req: TokenizeRequest, request: Request):
        """vLLM's /tokenize: a `prompt`, or chat `messages` through the chat template, to token ids."""
        tenant_of(request)  # authenticated by the guard (this fails if the route ever leaves it)
        check_fields(req, ingress.model.caps.accept_unknown_fields)
        ingress.model.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise ApiError(400, "give exactly one of prompt and messages", "prompt")
        if req.messages is not None:
            messages = [m.model_dump() for m in req.messages]
            check_text(json.dumps([messages, req.chat_template_kwargs], ensure_ascii=False), "messages")
            options = TemplateOptions(req.add_generation_prompt, req.continue_final_message,
                                      req.chat_template_kwargs or {}, bool(req.add_special_tokens))
            ids = await asyncio.to_thread(ingress.model.chat_prompt, messages, None, options)
        else:
            for name in ("add_generation_prompt", "continue_final_message", "chat_template_kwargs"):
                if name in req.model_fields_set:
                    raise ApiError(400, f"{name} applies to messages, not to a prompt", name)
            check_text(req.prompt, "prompt")
            ids = await asyncio.to_thread(ingress.model.tokenizer.encode, req.prompt,
                                          add_special_tokens=req.add_special_tokens is not False)
        return {"count": len(ids), "max_model_len": ingress.model.max_model_len, "tokens": ids, "token_strs": None}

    @app.post("/detokenize", response_model=None, responses=documented(DetokenizeResponse, 400, 401, 404, 413))
    async def detokenize(req: DetokenizeRequest, request: Request):
        """vLLM's /detokenize: token ids to text."""
        tenant_of(request)  # authenticated by the guard (this fails if the route ever leaves it)
        check_fields(req, ingress.model.caps.accept_unknown_fields)
        ingress.model.check_model(req.model)
        bad = [t for t in req.tokens if not 0 <= t < ingress.model.vocab_size]
        if bad:
            raise ApiError(400, f"tokens holds ids outside the vocabulary [0, {ingress.model.vocab_size}): {bad[:8]}", "tokens")
        return {"prompt": await asyncio.to_thread(ingress.model.tokenizer.decode, req.tokens)}

    @app.get("/tokenizer_info", response_model=None, responses=documented(TokenizerInfoResponse, 401))
    async def tokenizer_info(request: Request):
        """vLLM's /tokenizer_info: the tokenizer's class, special tokens and chat template (lm-eval reads it)."""
        tenant_of(request)  # authenticated by the guard (this fails if the route ever leaves it)
        tok = ingress.model.tokenizer
        return {"tokenizer_class": type(tok).__name__, "eos_token": tok.eos_token, "bos_token": tok.bos_token,
                "pad_token": tok.pad_token, "chat_template": tok.chat_template, "model_max_length": ingress.model.max_model_len}

    @app.get("/version", response_model=None, responses=documented(VersionResponse))
    async def version():
        """The installed tandem's version."""
        try:
            return {"version": importlib.metadata.version("tandem")}
        except importlib.metadata.PackageNotFoundError:  # run from a checkout without installing it
            return {"version": "unknown"}
