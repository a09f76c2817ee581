"""What the engine hands back: per-step deltas and whole offline results."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Hashable

from actors.protocol.request_status import RequestStatus


@dataclass(frozen=True)
class EngineLoad:
    """How full one engine is, as its worker reports it."""

    free_blocks: int
    num_blocks: int
    used_blocks: int
    running: int
    waiting: int
    queued_prefill_tokens: int
    preemptions: int
    queued_prefill_by_tenant: dict[str | None, int] = field(default_factory=dict)


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # (token id, logprob), most likely first
    rank: int | None = None  # 1 + how many tokens were more likely (prompt logprobs)


@dataclass
class RequestOutput:
    """New tokens of one sequence (sample `index` of `request_id`) from one engine step."""

    request_id: Hashable
    index: int
    new_token_ids: list[int]
    new_text: str
    status: RequestStatus
    num_prompt_tokens: int
    num_cached_tokens: int
    new_logprobs: list[TokenLogprob] | None = None
    stop_reason: str | int | None = None  # the stop string or stop token that ended it
    num_output_tokens: int = 0  # output tokens of this sequence so far, these included
    first_scheduled_time: float | None = None  # wall clock of the sequence's first step
    prompt_logprobs: list[TokenLogprob | None] | None = None  # with the first token, when asked for
    tag: Any = None  # the caller's context of the request (Engine.add_request's `tag`)

    @property
    def finished(self) -> bool:
        return self.status.is_finished()

    @property
    def finish_reason(self) -> str | None:
        return self.status.finish_reason()


@dataclass
class CompletionOutput:
    index: int
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[TokenLogprob] | None = None
    status: RequestStatus = RequestStatus.WAITING
    stop_reason: str | int | None = None

    @property
    def finish_reason(self) -> str | None:
        return self.status.finish_reason()


@dataclass
class GenerationResult:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    num_cached_tokens: int = 0
    prompt_logprobs: list[TokenLogprob | None] | None = None

    def absorb(self, out: RequestOutput) -> None:
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = out.prompt_logprobs
        c = self.outputs[out.index]
        c.token_ids.extend(out.new_token_ids)
        c.text += out.new_text
        if out.new_logprobs is not None:
            c.logprobs = (c.logprobs or []) + out.new_logprobs
        c.status = out.status
        c.stop_reason = out.stop_reason
        if out.index == 0:
            self.num_cached_tokens = out.num_cached_tokens
