"""Prompt logprobs (`SamplingParams.prompt_logprobs`): the logprob of every prompt token after the first
under the tokens before it, with the top alternatives, as lm-eval's loglikelihood tasks need them.

They are computed while the prompt is prefilled, chunk by chunk: the logits at position p score token
p + 1. A sequence that scores its prompt takes no prefix-cache hits (the logits of cached positions were
never kept), so every prompt token runs, once; its blocks still enter the cache for others. A
sequence recomputed after a preemption does not score again what it already scored.
"""

from __future__ import annotations

import torch

from actors.engine.outputs import TokenLogprob
from actors.engine.sampling import top_n
from actors.engine.sequence import Sequence


def score_rows(seqs: list[Sequence], num_new_tokens: list[int]) -> tuple[list[int], list[tuple[Sequence, int]]]:
    """Before a step: which flat token rows of the batch to keep logits for, and (sequence, prompt index
    scored) for each. Call before the sequences' computed counts advance."""
    rows, scored = [], []
    offset = 0
    for seq, n in zip(seqs, num_new_tokens):
        if seq.scores_prompt:
            if seq.prompt_logprobs is None:
                seq.prompt_logprobs = [None]  # the first token has no context to score it
            start = seq.num_computed_tokens
            for p in range(max(start, len(seq.prompt_logprobs) - 1), min(start + n, len(seq.prompt_token_ids) - 1)):
                rows.append(offset + p - start)
                scored.append((seq, p + 1))
        offset += n
    return rows, scored


def record(scored: list[tuple[Sequence, int]], logits: torch.Tensor) -> None:
    """After the forward: the scored rows' logits [len(scored), vocab] become prompt logprob entries."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    targets = torch.tensor([seq.prompt_token_ids[i] for seq, i in scored], device=logprobs.device)
    picked = logprobs.gather(1, targets.unsqueeze(1))
    ranks = ((logprobs > picked).sum(dim=1) + 1).tolist()
    picked = picked.squeeze(1).tolist()
    k = min(max(seq.params.prompt_logprobs for seq, _ in scored), logprobs.shape[1])
    top_values, top_ids = top_n(logprobs, k) if k else ([[]] * len(scored),) * 2
    for (seq, i), lp, rank, ids, values in zip(scored, picked, ranks, top_ids, top_values):
        if len(seq.prompt_logprobs) != i:
            raise RuntimeError(f"sequence {seq.seq_id}: prompt token {i} scored out of order")
        n = seq.params.prompt_logprobs
        seq.prompt_logprobs.append(TokenLogprob(seq.prompt_token_ids[i], lp, list(zip(ids[:n], values[:n])), rank))
