"""Per-request sampling parameters, validated once when a request enters the engine."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from actors.protocol.structured_output import StructuredOutput


@dataclass(frozen=True)
class SamplingParams:
    n: int = 1
    max_tokens: int = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None  # None: no top-k filter
    min_p: float = 0.0
    typical_p: float = 1.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    # A dict cannot be hashed: keep it out of __hash__ (equality still compares it).
    logit_bias: dict[int, float] | None = field(default=None, hash=False)
    allowed_token_ids: tuple[int, ...] | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None  # None: no logprobs; 0: the chosen token only; N: chosen + top N
    prompt_logprobs: int | None = None  # the same for every prompt token after the first (scored in prefill)
    structured_output: StructuredOutput | None = None  # what the output must match (a grammar mask per token)
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        # Accept lists from callers, store tuples so params stay hashable and immutable.
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        if self.allowed_token_ids is not None:
            object.__setattr__(self, "allowed_token_ids", tuple(self.allowed_token_ids))
        if self.logit_bias is not None:
            # Our own copy, so a caller mutating its dict cannot change validated params.
            object.__setattr__(self, "logit_bias", dict(self.logit_bias))
        self._validate()

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    def _validate(self) -> None:
        def bad(name: str, why: str) -> ValueError:
            return ValueError(f"invalid sampling parameter {name}={getattr(self, name)!r}: {why}")

        if not isinstance(self.n, int) or self.n < 1:
            raise bad("n", "must be an integer >= 1")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise bad("max_tokens", "must be an integer >= 1")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise bad("min_tokens", "must be an integer >= 0")
        if self.min_tokens > self.max_tokens:
            raise bad("min_tokens", f"must not exceed max_tokens={self.max_tokens}")
        if not (math.isfinite(self.temperature) and self.temperature >= 0.0):
            raise bad("temperature", "must be a finite number >= 0 (0 means greedy)")
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", "must be in (0, 1]")
        if self.top_k is not None and (not isinstance(self.top_k, int) or self.top_k < 1):
            raise bad("top_k", "must be an integer >= 1, or None to disable")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", "must be in [0, 1]")
        if not 0.0 < self.typical_p <= 1.0:
            raise bad("typical_p", "must be in (0, 1]")
        if not (math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0.0):
            raise bad("repetition_penalty", "must be a finite number > 0 (1 disables it)")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise bad("frequency_penalty", "must be in [-2, 2]")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise bad("presence_penalty", "must be in [-2, 2]")
        if self.seed is not None and (not isinstance(self.seed, int) or not -(2**63) <= self.seed < 2**63 - 64):
            raise bad("seed", "must be an integer that fits in 64 bits")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 20):
                raise bad(name, "must be an integer in [0, 20], or None")
        if any(not isinstance(s, str) or s == "" for s in self.stop):
            raise bad("stop", "every stop string must be a non-empty string")
        if self.logit_bias is not None and any(
            not isinstance(v, (int, float)) or not math.isfinite(v) for v in self.logit_bias.values()
        ):
            raise bad("logit_bias", "every bias must be a finite number")
        if self.allowed_token_ids is not None and len(self.allowed_token_ids) == 0:
            raise bad("allowed_token_ids", "must not be empty when given")

    def validate_token_ids(self, vocab_size: int) -> None:
        """Token ids named in the params must exist in the model's vocabulary; no list may name more ids
        than the vocabulary holds (a longer one only repeats them, and every caller that reaches the engine
        without the ingress's caps, e.g. the Python client, is bounded by this)."""
        named = {
            "stop_token_ids": self.stop_token_ids,
            "allowed_token_ids": self.allowed_token_ids or (),
            "logit_bias": tuple(self.logit_bias or {}),
        }
        for name, ids in named.items():
            if len(ids) > vocab_size:
                raise ValueError(f"invalid sampling parameter {name}: {len(ids)} token ids, more than the "
                                 f"vocabulary's {vocab_size}")
            for tid in ids:
                if not isinstance(tid, int) or not 0 <= tid < vocab_size:
                    raise ValueError(
                        f"invalid sampling parameter {name}: token id {tid!r} is outside the vocabulary [0, {vocab_size})"
                    )
