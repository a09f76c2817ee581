"""A request's checks before it enters an engine: a bad prompt or bad parameters raise `ValueError`
naming what was wrong and how to fix it, and nothing in the engine changes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from actors.protocol.sampling_params import SamplingParams


@dataclass(frozen=True)
class RequestLimits:
    vocab_size: int
    max_model_len: int
    block_size: int
    num_kv_blocks: int
    chunked_prefill: bool
    max_num_batched_tokens: int
    detokenize: bool
    eos_token_ids: frozenset[int]


def validate_request(limits: RequestLimits, tokenizer, prompt: str | Sequence[int], params: SamplingParams) -> list[int]:
    """The prompt's token ids, once the prompt and parameters fit this engine."""
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError("this model directory has no tokenizer: pass the prompt as token ids")
        prompt_ids = tokenizer.encode(prompt)
    else:
        prompt_ids = list(prompt)
        bad = [t for t in prompt_ids if not isinstance(t, int) or not 0 <= t < limits.vocab_size]
        if bad:
            raise ValueError(f"prompt token id {bad[0]!r} is outside the vocabulary [0, {limits.vocab_size})")
    if not prompt_ids or (isinstance(prompt, str) and not prompt):
        raise ValueError("prompt is empty: give at least one token")
    if len(prompt_ids) >= limits.max_model_len:
        raise ValueError(
            f"prompt has {len(prompt_ids)} tokens but the context is {limits.max_model_len} "
            f"(max_model_len); shorten the prompt to leave room for at least one new token"
        )
    blocks_needed = -(-(len(prompt_ids) + 1) // limits.block_size)
    if blocks_needed > limits.num_kv_blocks:
        raise ValueError(
            f"prompt needs {blocks_needed} KV blocks but the cache has {limits.num_kv_blocks}"
        )
    if not limits.chunked_prefill and len(prompt_ids) > limits.max_num_batched_tokens:
        raise ValueError(
            f"prompt has {len(prompt_ids)} tokens, above max_num_batched_tokens="
            f"{limits.max_num_batched_tokens} with chunked prefill off"
        )
    params.validate_token_ids(limits.vocab_size)
    if params.allowed_token_ids is not None and params.min_tokens > 0:
        banned_early = limits.eos_token_ids | set(params.stop_token_ids)
        if set(params.allowed_token_ids) <= banned_early:
            raise ValueError(
                "allowed_token_ids holds only end-of-sequence or stop tokens, which min_tokens forbids: "
                "no token could be sampled"
            )
    if params.stop and tokenizer is None and limits.detokenize:
        raise ValueError("stop strings need a tokenizer; this model directory has none (use stop_token_ids)")
    return prompt_ids
