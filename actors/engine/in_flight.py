"""Overlapped steps: the engine launches step N+1 before it reads step N's tokens back (engine.py).

On a GPU the host then schedules, builds the inputs of and launches the next step while the device still
runs the current one, and post-processes a step's tokens while the next one runs; on a CPU every op is
synchronous and the same order only shows that the bookkeeping is right (tests run it that way).

What a step in flight leaves behind is a `LaunchedStep`: its sequences and how far each one's KV will
reach, and the draw of its tokens, still on the device. A sampled sequence counts its token as pending
(`Sequence.num_pending`) until the step is resolved. It may run its next step meanwhile only when it is
`blind`: nothing that step does depends on the pending token's value except the input id itself, which
the device feeds in from the draw (`TokenFeed`). Everything else waits one step for its token: a
sequence about to hand its KV off, fork or end by length, and sampling that reads its past tokens
(penalties, a grammar, `min_tokens` not yet met).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from actors.engine.batcher import ScheduledBatch
from actors.engine.kv.cache_manager import KVCacheManager
from actors.engine.model.runner import TokenFeed
from actors.engine.sampling import Draw
from actors.engine.sequence import Sequence

log = logging.getLogger(__name__)


def overlap_wanted(setting: bool | None, device: torch.device, tp_size: int) -> bool:
    """`engine.overlap_steps`: None (auto) overlaps on a CUDA device; True anywhere (on a CPU it saves
    nothing, and a token reaches its caller one step later). Never across tensor-parallel ranks: they take
    their input ids from rank 0's plan, which cannot wait for the device."""
    wanted = device.type == "cuda" if setting is None else setting
    if wanted and tp_size > 1:
        log.info("overlapped steps skipped: %d tensor-parallel ranks take their input ids from the host", tp_size)
        return False
    return wanted


@dataclass(frozen=True)
class StepInputs:
    """What the model runner takes for one step (ModelRunner.execute)."""

    token_ids: list[int]  # flat; placeholders where `feed` brings the id from the device
    query_lens: list[int]
    computed_lens: list[int]
    tables: list[list[int]]
    sample_rows: list[int]  # the batch's sequences that sample this step (their last query token is their last)
    feed: TokenFeed | None

    @classmethod
    def of(cls, batch: ScheduledBatch, kv: KVCacheManager, prev: LaunchedStep | None) -> StepInputs:
        token_ids: list[int] = []
        query_lens, computed_lens, tables, sample_rows, fed = [], [], [], [], []
        for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_new_tokens)):
            start = seq.num_computed_tokens
            known = min(start + n, seq.num_known_tokens)
            token_ids.extend(seq.token_slice(start, known))
            for _ in range(start + n - known):  # at most the one token a blind sequence has pending
                fed.append((len(token_ids), seq))
                token_ids.append(0)
            query_lens.append(n)
            computed_lens.append(start)
            tables.append(kv.block_table(seq.seq_id))
            if start + n == seq.num_tokens:
                sample_rows.append(i)
        if fed and prev is None:
            raise RuntimeError(f"{len(fed)} input ids of the step are pending, and no step is in flight")
        return cls(token_ids, query_lens, computed_lens, tables, sample_rows, prev.feed(fed) if fed else None)


def may_stay_in_flight(batch: ScheduledBatch) -> bool:
    """Whether a step may be left in flight: not when it scores prompt tokens or a sample forks (both need
    the host's answer at once)."""
    return not any(s.scores_prompt or (s.pending_forks and s.num_computed_tokens + n == s.num_tokens)
                   for s, n in zip(batch.seqs, batch.num_new_tokens))


@dataclass
class LaunchedStep:
    seqs: list[Sequence]  # the batch, in order
    computed_before: list[int]  # each one's num_computed_tokens before the step
    computed_after: list[int]  # ... and once the step's KV is written
    samplers: list[Sequence]  # one per drawn token, in the draw's row order
    draw: Draw
    _rows: dict[int, int] = field(default_factory=dict)  # id(sequence) -> its row in the draw

    def __post_init__(self) -> None:
        self._rows = {id(seq): row for row, seq in enumerate(self.samplers)}

    def feed(self, wanted: list[tuple[int, Sequence]]) -> TokenFeed | None:
        """The next step's input ids still on the device: (flat token index, sequence) for each."""
        if not wanted:
            return None
        return TokenFeed([pos for pos, _ in wanted], [self._rows[id(seq)] for _, seq in wanted], self.draw.chosen)

    def pending_counts(self) -> dict[int, int]:
        """id(sequence) -> the tokens this step leaves pending for it."""
        counts: dict[int, int] = {}
        for seq in self.samplers:
            counts[id(seq)] = counts.get(id(seq), 0) + 1
        return counts


def runs_blind(seq: Sequence, max_model_len: int) -> bool:
    """Whether `seq`, with its just-drawn tokens pending, may run its next step before they are known."""
    p = seq.params
    outputs = len(seq.output_token_ids) + seq.num_pending
    if seq.hand_off or seq.pending_forks or outputs >= p.max_tokens or seq.num_tokens >= max_model_len:
        return False  # the pending token parks, forks or ends it whatever its value
    return (seq.grammar is None and p.repetition_penalty == 1.0 and p.frequency_penalty == 0.0
            and p.presence_penalty == 0.0 and len(seq.output_token_ids) >= p.min_tokens)
