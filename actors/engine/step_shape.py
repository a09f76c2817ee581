"""What one engine step computed, summarised the way its cost depends on it: the five numbers of the
capacity model's `BatchShape` (cluster/control/autoscale/profile.py), so that a running worker's steps
can refit the planner's cost model (`tandem plan profile --from-server`).

A sequence computing one token after all of its known tokens is a decode; anything else (a prompt, a
chunk of one, a migrated request recomputing its output) is prefill work, its attention charged the
n * computed + n (n + 1) / 2 query-key pairs of a causal chunk.
"""

from __future__ import annotations

from typing import NamedTuple


class StepShape(NamedTuple):
    prefill_tokens: int = 0
    prefill_pairs: int = 0
    prefill_samples: int = 0  # prompts that finish in the step (each samples its first token)
    decode_seqs: int = 0
    decode_context: int = 0  # KV entries the decode tokens attend to, their own included


def shape_of(seqs, num_new_tokens) -> StepShape:
    """The shape of a batch about to run (its sequences' `num_computed_tokens` not yet advanced)."""
    p_tokens = p_pairs = p_samples = d_seqs = d_context = 0
    for seq, n in zip(seqs, num_new_tokens):
        computed = seq.num_computed_tokens
        if n == 1 and computed >= len(seq.prompt_token_ids) and computed + 1 >= seq.num_tokens:
            d_seqs += 1
            d_context += computed + 1
        else:
            p_tokens += n
            p_pairs += n * computed + n * (n + 1) // 2
            p_samples += int(computed + n >= seq.num_tokens)
    return StepShape(p_tokens, p_pairs, p_samples, d_seqs, d_context)
