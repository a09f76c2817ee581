"""One sequence the engine schedules: a request's prompt plus one sample's generated tokens.

A request with n > 1 samples becomes n sequences that share the prompt's KV blocks. "Prefill" and
"decode" are roles of workers, not of sequences: a sequence only tracks how many of its tokens have
KV in the cache (`num_computed_tokens`) against how many it has (`num_tokens`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from actors.protocol.request_status import RequestStatus
from actors.protocol.sampling_params import SamplingParams


@dataclass(eq=False)
class Sequence:
    request_id: str
    index: int  # sample index within the request (0..n-1)
    prompt_token_ids: list[int]
    params: SamplingParams
    cache_salt: str | None = None
    generator: torch.Generator | None = None
    detokenizer: object | None = None  # IncrementalDetokenizer when the engine has a tokenizer
    arrival_time: float = field(default_factory=time.monotonic)
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int | None = None  # prompt tokens served from the prefix cache; None until scheduled
    status: RequestStatus = RequestStatus.WAITING
    stop_reason: str | int | None = None
    pending_forks: int = 0  # children still to fork off once the prompt is computed (n > 1)
    hand_off: bool = False  # prefill role: after the first token, hold the KV for a decode worker
    first_scheduled_time: float | None = None  # wall clock of its first step; None while it waits
    # Prompt logprobs (params.prompt_logprobs): one entry per prompt token scored so far, None for the first.
    prompt_logprobs: list | None = None
    grammar: object | None = None  # its structured-output GrammarState (structured.py), when params ask for one
    # Overlapped steps (engine.py): tokens sampled by steps still in flight, not yet in output_token_ids
    # (they count in num_tokens), and whether its next step may run before they are known (`blind`: the
    # device feeds the sampled token in as the next input; otherwise it waits until they are appended).
    num_pending: int = 0
    blind: bool = False

    @property
    def scores_prompt(self) -> bool:
        """Its prompt's logprobs are still to be computed: every prompt token must run, none from the cache.
        Not once it has a token: they went out with the first (or, adopted or migrated, from elsewhere)."""
        return (self.params.prompt_logprobs is not None and not self.output_token_ids
                and len(self.prompt_logprobs or ()) < len(self.prompt_token_ids))

    @property
    def seq_id(self) -> tuple[str, int]:
        return (self.request_id, self.index)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids) + self.num_pending

    @property
    def num_known_tokens(self) -> int:
        """Tokens whose ids are on the host (num_tokens less the pending ones)."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def waits_for_token(self) -> bool:
        """A step in flight sampled its next token, and its next step needs that token's value first."""
        return self.num_pending > 0 and not self.blind

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    def token_slice(self, start: int, end: int) -> list[int]:
        n_prompt = len(self.prompt_token_ids)
        if end <= n_prompt:
            return self.prompt_token_ids[start:end]
        if start >= n_prompt:
            return self.output_token_ids[start - n_prompt : end - n_prompt]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - n_prompt]
