"""One simulated worker: the engine batcher's policy over request counters, without a model.

Each step mirrors `actors/engine/batcher.py`: running decodes first (one token each), then unfinished prefill
chunks, then waiting requests admitted in FIFO order while the token budget (max_num_batched_tokens),
max_num_seqs and (on a prefill worker) free KV blocks allow; a prompt longer than the budget left is
chunked. A decode worker computes at most `decode_prompt_cap` prompt tokens a step (the engine's
`Batcher.max_prefill_tokens`). A prefill worker takes a whole prompt's blocks on admission and holds
them until its KV has left (the real batcher allocates per chunk; without preemption the two agree).
Decode and colocated workers never run out of KV because the scheduler admits a request only with
prompt + output reserved (the `prompt_plus_max_tokens` policy), so they never preempt.

Decoding sequences are kept as totals (count, context) plus a heap of finish steps, so a step costs
O(prefill chunks + finishing requests), not O(batch): the planner runs thousands of simulations.
"""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass

from cluster.control.autoscale.profile import BatchShape, EngineProfile, chunk_pairs
from experiments.capacity.workload import SimRequest


@dataclass
class SimSeq:
    """A request's life in the simulated cluster; its fields are the per-request result too."""

    index: int
    request: SimRequest
    prefill_worker: str | None = None
    decode_worker: str | None = None
    submitted_s: float | None = None  # when the scheduler placed it (its decode reservation's lease starts)
    computed: int = 0  # prompt tokens computed so far
    adopted: bool = False  # arrived on a decode worker with its prompt KV in place
    blocks_held: int = 0  # on a prefill worker, until the KV transfer is done
    first_token_s: float | None = None
    decode_first_step: int | None = None  # step (on decode_worker) that produced token 2
    finish_s: float | None = None
    rejected: str | None = None  # never admitted, or failed (a lease that ran out)

    @property
    def uncomputed(self) -> int:
        return 0 if self.adopted else self.request.prompt_len - self.computed


class SimWorker:
    def __init__(self, worker_id: str, role: str, profile: EngineProfile, decode_prompt_cap: int | None = None):
        """`decode_prompt_cap`: in the decode role, the most prompt tokens a step computes (the engine's
        `Batcher.max_prefill_tokens`)."""
        self.worker_id = worker_id
        self.decode_prompt_cap = decode_prompt_cap
        self.role = role  # prefill | decode | colocated
        self.profile = profile
        self.limits = profile.engine
        self.waiting: deque[SimSeq] = deque()
        self.prefilling: list[SimSeq] = []
        self.decode_count = 0
        self.decode_computed = 0  # sum of computed tokens (prompt + outputs so far) of decoding sequences
        self._finishes: list[tuple[int, int, SimSeq]] = []  # (finish step, request index, seq)
        self.free_blocks = self.limits.num_kv_blocks  # prefill role: physical blocks
        self.committed_blocks = 0  # decode/colocated: blocks the scheduler promised to admitted requests
        self.busy = False
        self.step_s: float | None = None  # smoothed step time, what a real worker reports (its requests' TPOT)
        self.step_ends: list[float] = []
        self.link_free_s = 0.0  # when this worker's outgoing KV link is next idle
        self.prefill_s_per_token: float | None = None  # the worker's own moving average, like the real one
        self._batch: list[tuple[SimSeq, int]] = []
        self._step_decodes = 0

    # ---- what the scheduler sees ----

    def queued_prefill_tokens(self) -> int:
        return sum(s.uncomputed for s in self.waiting) + sum(s.uncomputed for s in self.prefilling)

    def drain_eta_s(self, oldest_reservation_s: float = 0.0) -> float:
        """How long it may take to finish what it holds, at the cost of its current batch: its longest
        answer's remaining steps, after its queued prompts, plus the age of its oldest reservation still
        waiting for KV (`oldest_reservation_s`, as the real worker's `drain_estimate_s`)."""
        eta = self.profile.prefill_s(self.queued_prefill_tokens()) if self.queued_prefill_tokens() else 0.0
        eta += oldest_reservation_s
        if self.decode_count:
            steps = max(step for step, _, _ in self._finishes) - len(self.step_ends) + 1
            eta += max(steps, 0) * self.profile.step_s(
                BatchShape(decode_seqs=self.decode_count, decode_context=self.decode_computed + self.decode_count))
        return eta

    @property
    def running(self) -> int:
        return self.decode_count + len(self.prefilling)

    # ---- one step ----

    def start_step(self) -> BatchShape | None:
        """Choose the next batch; None if there is nothing to compute now."""
        budget = self.limits.max_num_batched_tokens - self.decode_count
        capped = self.role == "decode" and self.decode_prompt_cap is not None
        prompt_left = self.decode_prompt_cap if capped else budget  # adoptions do not count against it
        step = len(self.step_ends)
        batch: list[tuple[SimSeq, int]] = []
        for seq in self.prefilling:
            if min(budget, prompt_left) <= 0:
                break
            n = min(seq.uncomputed, budget, prompt_left)
            batch.append((seq, n))
            budget, prompt_left = budget - n, prompt_left - n
        while self.waiting and budget > 0 and self.running < self.limits.max_num_seqs:
            seq = self.waiting[0]
            if seq.adopted:
                self.waiting.popleft()
                self._begin_decoding(seq, step)
                budget -= 1
                continue
            if prompt_left <= 0:
                break  # FIFO here (the engine lets an adopted one pass; in the simulator they rarely queue)
            n = min(seq.uncomputed, budget, prompt_left)
            if self.role == "prefill":
                blocks = -(-seq.request.prompt_len // self.limits.block_size)
                if blocks > self.free_blocks:
                    break
                self.free_blocks -= blocks
                seq.blocks_held = blocks
            self.waiting.popleft()
            self.prefilling.append(seq)
            batch.append((seq, n))
            budget, prompt_left = budget - n, prompt_left - n
        prefill_tokens = sum(n for _, n in batch)
        shape = BatchShape(
            prefill_tokens=prefill_tokens,
            prefill_pairs=sum(chunk_pairs(n, s.computed) for s, n in batch),
            prefill_samples=sum(1 for s, n in batch if s.computed + n == s.request.prompt_len),
            decode_seqs=self.decode_count,
            decode_context=self.decode_computed + self.decode_count,
        )
        if shape.empty:
            return None
        self._batch, self._step_decodes = batch, self.decode_count
        self.busy = True
        return shape

    def finish_step(self, now: float, duration: float) -> tuple[list[SimSeq], list[SimSeq]]:
        """Apply the step that just ended; returns (prompts completed, requests finished)."""
        step = len(self.step_ends)
        self.step_ends.append(now)
        self.busy = False
        self.step_s = duration if self.step_s is None else 0.8 * self.step_s + 0.2 * duration  # as the worker's meter
        tokens = sum(n for _, n in self._batch) + self._step_decodes
        if tokens >= 32:  # the real worker's rule: prefill-dominated steps give the per-token cost
            cost = duration / tokens
            prev = self.prefill_s_per_token
            self.prefill_s_per_token = cost if prev is None else 0.8 * prev + 0.2 * cost
        self.decode_computed += self._step_decodes
        finished = []
        while self._finishes and self._finishes[0][0] == step:
            seq = heapq.heappop(self._finishes)[2]
            self.decode_count -= 1
            self.decode_computed -= seq.request.prompt_len + seq.request.output_len - 1
            seq.finish_s = now
            finished.append(seq)
        completed = []
        for seq, n in self._batch:
            seq.computed += n
            if seq.computed == seq.request.prompt_len:
                seq.first_token_s = now
                self.prefilling.remove(seq)
                completed.append(seq)
                if seq.request.output_len == 1:
                    seq.finish_s = now
                    finished.append(seq)
                elif self.role != "prefill":
                    self._begin_decoding(seq, step + 1)
        self._batch = []
        return completed, finished

    def _begin_decoding(self, seq: SimSeq, first_step: int) -> None:
        """From `first_step` on, the sequence makes one token per step until its output is complete."""
        seq.decode_worker = self.worker_id
        seq.decode_first_step = first_step
        self.decode_count += 1
        self.decode_computed += seq.request.prompt_len
        heapq.heappush(self._finishes, (first_step + seq.request.output_len - 2, seq.index, seq))
