"""The per-worker scheduler: continuous batching under a token budget, chunked prefill, preemption.

Every step it picks which sequences run and how many tokens each computes. Running sequences go
first (a decode is one token; an unfinished prefill continues its chunk), then waiting sequences are
admitted while the budget, `max_num_seqs` and free KV blocks allow. When a running sequence cannot
get a block, the newest running sequence is preempted: its blocks are freed and it waits at the head
of the queue to be recomputed (prefix-cache hits make that cheap).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

from actors.engine.kv.cache_manager import KVCacheManager
from actors.engine.sequence import Sequence
from actors.protocol.request_status import RequestStatus


@dataclass
class ScheduledBatch:
    seqs: list[Sequence]
    num_new_tokens: list[int]  # tokens each sequence computes this step
    preempted: list[Sequence]

    @property
    def total_tokens(self) -> int:
        return sum(self.num_new_tokens)


class Batcher:
    def __init__(
        self,
        kv: KVCacheManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        enable_chunked_prefill: bool,
    ):
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enable_chunked_prefill = enable_chunked_prefill
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence, front: bool = False) -> None:
        (self.waiting.appendleft if front else self.waiting.append)(seq)

    def load(self) -> tuple[int, int]:
        """(running, waiting) sequences."""
        return len(self.running), len(self.waiting)

    def queued_ids(self) -> set:
        return {s.seq_id for s in self.running} | {s.seq_id for s in self.waiting}

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def queued_prefill_tokens(self) -> int:
        """Prompt tokens not yet computed: waiting sequences and unfinished prefill chunks."""
        waiting = sum(s.num_uncomputed_tokens for s in self.waiting)
        return waiting + sum(s.num_uncomputed_tokens for s in self.running if s.num_uncomputed_tokens > 1)

    def schedule(self) -> ScheduledBatch:
        budget = self.max_num_batched_tokens
        batch = ScheduledBatch([], [], [])

        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_uncomputed_tokens, budget)
            if not self._allocate_or_preempt(seq, n, batch):
                break  # seq itself was preempted; everything after it already was
            batch.seqs.append(seq)
            batch.num_new_tokens.append(n)
            budget -= n
            i += 1

        # Admit new work only when nothing had to be preempted this step: room is tight.
        while self.waiting and budget > 0 and not batch.preempted and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if seq.num_computed_tokens == 0 and not self.kv.has(seq.seq_id):
                cached = self.kv.get_computed_blocks(seq.seq_id, seq.all_token_ids, seq.cache_salt)
                seq.num_computed_tokens = cached
                if seq.num_cached_tokens is None:
                    seq.num_cached_tokens = cached
            n = seq.num_uncomputed_tokens
            if n > budget:
                if not self.enable_chunked_prefill:
                    break
                n = budget
            if self.kv.allocate_slots(seq.seq_id, seq.num_computed_tokens + n) is None:
                self.kv.free(seq.seq_id)  # drop the prefix hits it held; retried next step
                seq.num_computed_tokens = 0
                break
            self.waiting.popleft()
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = time.time()
            # An adopted sequence arrives with its prompt's KV already in place.
            prompt_done = seq.num_computed_tokens >= len(seq.prompt_token_ids)
            seq.status = RequestStatus.DECODING if prompt_done else RequestStatus.PREFILLING
            self.running.append(seq)
            batch.seqs.append(seq)
            batch.num_new_tokens.append(n)
            budget -= n
        return batch

    def _allocate_or_preempt(self, seq: Sequence, n: int, batch: ScheduledBatch) -> bool:
        """Make room for n more tokens of seq, preempting the newest running sequences if needed."""
        while self.kv.allocate_slots(seq.seq_id, seq.num_computed_tokens + n) is None:
            victim = self.running.pop()
            self._preempt(victim)
            batch.preempted.append(victim)
            if victim is seq:
                return False
        return True

    def _preempt(self, seq: Sequence) -> None:
        self.kv.free(seq.seq_id)
        seq.num_computed_tokens = 0
        seq.status = RequestStatus.PREEMPTED
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def admit_running(self, seq: Sequence) -> bool:
        """Put a sequence whose blocks are already allocated (a forked sample) straight into the running
        batch; False when the batch is full."""
        if len(self.running) >= self.max_num_seqs:
            return False
        self.running.append(seq)
        return True

    def park(self, seq: Sequence) -> None:
        """Take a running sequence out of the batch, its blocks kept (a prefill waiting for its handoff)."""
        self.running.remove(seq)

    def finish(self, seq: Sequence, status: RequestStatus) -> None:
        """Take a sequence out of the queues and free its blocks; idempotent."""
        if seq.status.is_finished():
            return
        seq.status = status
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.kv.free(seq.seq_id)

    def check_integrity(self) -> None:
        self.kv.check_integrity()
        for seq in self.running:
            if seq.status.is_finished():
                raise RuntimeError(f"finished sequence {seq.seq_id} still in the running queue")
        ids = [s.seq_id for s in self.running] + [s.seq_id for s in self.waiting]
        if len(ids) != len(set(ids)):
            raise RuntimeError(f"a sequence is queued twice: {len(ids)} entries, {len(set(ids))} distinct")
        if len(self.running) > self.max_num_seqs:
            raise RuntimeError(f"{len(self.running)} running sequences exceed max_num_seqs={self.max_num_seqs}")
