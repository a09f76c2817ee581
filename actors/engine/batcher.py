"""The per-worker scheduler: continuous batching under a token budget, chunked prefill, preemption.

Every step it picks which sequences run and how many tokens each computes. Running sequences go
first (a decode is one token; an unfinished prefill continues its chunk), then waiting sequences are
admitted while the budget, `max_num_seqs` and free KV blocks allow. When a running sequence cannot
get a block, the newest running sequence is preempted: its blocks are freed and it waits at the head
of the queue to be recomputed (prefix-cache hits make that cheap).

With overlapped steps (engine.py) a sequence may have a token pending from a step still in flight: it
runs its next token only if it is `blind` (the device feeds that token in), is never chosen as another
sequence's preemption victim, and is never admitted from the waiting queue until its token is known.

Tenants (a sequence's `cache_salt`): while sequences of several tenants wait or run (and prefills can
be chunked), a step is capped at the tokens that keep it within `tenant_slowdown` x the measured cost of
a one-token step (`StepCost`), and filled taking one sequence of each tenant in turn, the tenant with
the fewest running first; the ones that ran go to the back of the line, so every sequence of a big
tenant still gets its turns. One tenant's flood then slows another's tokens by at most that factor,
wherever batching makes steps slower at all (on a CPU; rarely on a GPU).

A prompt cap (`max_prefill_tokens`, a decode worker's): with chunked prefill, no step computes more
prompt tokens than it, whatever the token budget; decodes and adopted requests do not count against it.

TPOT (`step_budget_s`, engine.step_budget_ms): decodes go first in every step (running ones, then adopted
ones waiting), prompt work after. A step that carries decodes takes only the prompt tokens that keep its
predicted seconds (`StepCost`, by the step's total tokens) within the budget, and never fewer than
`MIN_PREFILL_TOKENS` (so a prompt always progresses, however many decodes share its steps); a step with no
decode (nobody waits on a token) takes the whole token budget. Until two sizes of step were measured, the
token budget alone. Off by default: on a CPU the small prompt chunks it makes compute less efficiently, and
a shared 2-core box measured TTFT and TPOT p50 worse with it (experiments/bench_step_budget.py); what it
buys is a bound on the longest step beside decodes. vLLM's scheduler caps a step by tokens only
(`max_num_batched_tokens`, and a long prompt's share by `long_prefill_token_threshold`): the right token
count for a TPOT differs by model, batch and machine; this asks the worker's own measured step cost.
"""

from __future__ import annotations

import time
from collections import Counter, deque
from dataclasses import dataclass

from actors.engine.kv.cache_manager import KVCacheManager
from actors.engine.sequence import Sequence
from actors.engine.step_cost import StepCost
from actors.protocol.request_status import RequestStatus

# The fewest prompt tokens a step with decodes computes (when a prompt is there): the budget never starves a
# prompt, at worst it advances this much a step (two KV blocks of 16), however slow the decodes alone are.
MIN_PREFILL_TOKENS = 32


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
        tenant_slowdown: float | None = None,
        step_budget_s: float | None = None,
    ):
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enable_chunked_prefill = enable_chunked_prefill
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.tenant_slowdown = tenant_slowdown
        self.cost = StepCost()  # the engine reports every step's tokens and seconds
        self.capped_steps = 0  # steps cut below the token budget because several tenants shared them
        # The seconds a step carrying decodes may take (chunked prefill only); None: the token budget alone.
        self.step_budget_s = step_budget_s
        self.budgeted_steps = 0  # steps whose prompt tokens the step budget cut
        # The most prompt tokens one step computes (chunked prefill only); None: the token budget alone. A
        # decode worker's cap (Worker sets it): a prompt of any length prefilled there then slows its
        # decodes by one such chunk a step at most.
        self.max_prefill_tokens: int | None = None

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
        return sum(self.queued_prefill_by_tenant().values())

    def queued_prefill_by_tenant(self) -> dict[str | None, int]:
        """The same, by tenant (a sequence's cache salt)."""
        queued: dict[str | None, int] = {}
        for seq in (*self.waiting, *(s for s in self.running if s.num_uncomputed_tokens > 1)):
            queued[seq.cache_salt] = queued.get(seq.cache_salt, 0) + seq.num_uncomputed_tokens
        return queued

    def schedule(self) -> ScheduledBatch:
        budget = self.max_num_batched_tokens
        batch = ScheduledBatch([], [], [])
        prompt_left = self._prompt_room()
        # Only with chunked prefill: a prompt bigger than the cut could never be scheduled otherwise.
        if self.tenant_slowdown is not None and self.enable_chunked_prefill and self._tenants() > 1:
            return self._schedule_shared(batch, prompt_left)
        for seq in self._decodes_first(self.running):
            if budget <= 0:
                break
            allowed = self._allowed(seq, budget, prompt_left)
            if allowed == 0:
                continue  # a prompt chunk over this step's prompt cap: it goes on next step
            n = self._run(seq, allowed, batch)
            if n is None:
                break  # seq itself was preempted; everything after it already was
            budget -= n
            prompt_left = self._spent(seq, n, prompt_left)
        # Admit new work only when nothing had to be preempted this step: room is tight.
        for seq in self._decodes_first(self.waiting):
            allowed = self._allowed(seq, budget, prompt_left)
            if allowed == 0 and budget > 0:
                continue  # its prompt waits for a step with prompt room; an adopted one behind it need not
            n = self._admit(seq, allowed, batch) if allowed > 0 else None
            if n is None:
                break
            budget -= n
            prompt_left = self._spent(seq, n, prompt_left)
        return batch

    def _decodes_first(self, seqs) -> list[Sequence]:
        """Decodes before prompt work, each in queue order: a prompt chunk never takes a decode's budget."""
        seqs = list(seqs)
        return [s for s in seqs if not self._is_prompt_work(s)] + [s for s in seqs if self._is_prompt_work(s)]

    def _prompt_room(self) -> int | None:
        """The most prompt tokens this step computes: the prompt cap, and with a step budget and decodes to
        run, what the measured step cost leaves beside them (at least MIN_PREFILL_TOKENS); None: no limit."""
        cap = self._prompt_cap()
        if not self.enable_chunked_prefill or self.step_budget_s is None:
            return cap
        decodes = self._ready_decodes()
        if decodes == 0:
            return cap  # nothing waits on a token: the whole budget
        fit = self.cost.tokens_within(self.step_budget_s, self.max_num_batched_tokens)
        if fit is None:
            return cap  # not measured yet
        room = max(fit - decodes, MIN_PREFILL_TOKENS)
        if room >= (cap if cap is not None else self.max_num_batched_tokens - decodes):
            return cap
        self.budgeted_steps += self.queued_prefill_tokens() > room
        return room

    def _ready_decodes(self) -> int:
        """The decodes this step will run: running ones whose next input is known, and adopted ones waiting
        that fit the batch."""
        running = sum(1 for s in self.running if not self._is_prompt_work(s) and not s.waits_for_token
                      and s.status is not RequestStatus.PREEMPTED)
        adopted = sum(1 for s in self.waiting if not self._is_prompt_work(s) and not s.num_pending)
        return running + min(adopted, max(self.max_num_seqs - len(self.running), 0))

    def _schedule_shared(self, batch: ScheduledBatch, prompt_left: int | None) -> ScheduledBatch:
        """A step several tenants share: cut to what the measured step cost allows, one sequence of each
        tenant in turn, running or waiting alike (a tenant whose sequences all wait is not shut out by
        another's running ones); the ones that ran go to the back of the line."""
        budget = self.cost.max_tokens(self.tenant_slowdown, self.max_num_batched_tokens)
        self.capped_steps += budget < self.max_num_batched_tokens
        running = {s.seq_id for s in self.running}
        admitting = True
        for seq in self._in_turn(self.running + list(self.waiting)):
            if budget <= 0:
                break
            allowed = self._allowed(seq, budget, prompt_left)
            if allowed == 0:
                continue
            if seq.seq_id in running:
                n = self._run(seq, allowed, batch)
            else:
                n = self._admit(seq, allowed, batch) if admitting else None
                admitting = n is not None
            budget -= n or 0
            prompt_left = self._spent(seq, n or 0, prompt_left)
        ran = {s.seq_id for s in batch.seqs}
        self.running.sort(key=lambda s: s.seq_id in ran)
        return batch

    def _prompt_cap(self) -> int | None:
        return self.max_prefill_tokens if self.enable_chunked_prefill else None

    @staticmethod
    def _is_prompt_work(seq: Sequence) -> bool:
        """Part of its prompt left, or more than one token to compute (a recompute after preemption or a
        migration): not a decode (as `step_shape.shape_of` counts it)."""
        return seq.num_computed_tokens < len(seq.prompt_token_ids) or seq.num_uncomputed_tokens > 1

    def _allowed(self, seq: Sequence, budget: int, prompt_left: int | None) -> int:
        if prompt_left is None or not self._is_prompt_work(seq):
            return budget
        return min(budget, prompt_left)

    def _spent(self, seq: Sequence, n: int, prompt_left: int | None) -> int | None:
        """What is left of the step's prompt cap after `seq` was scheduled for `n` tokens (its count not
        yet advanced: the step has not run)."""
        return prompt_left if prompt_left is None or not self._is_prompt_work(seq) else prompt_left - n

    def _run(self, seq: Sequence, budget: int, batch: ScheduledBatch) -> int | None:
        """Schedule a running sequence's next tokens; None if it had to be preempted for lack of KV."""
        if seq.status is RequestStatus.PREEMPTED or seq.waits_for_token:
            return 0  # it made room for one scheduled before it in this step, or its next input is not known yet
        n = min(seq.num_uncomputed_tokens, budget)
        if not self._allocate_or_preempt(seq, n, batch):
            return None
        batch.seqs.append(seq)
        batch.num_new_tokens.append(n)
        return n

    def _admit(self, seq: Sequence, budget: int, batch: ScheduledBatch) -> int | None:
        """Move a waiting sequence into the running batch with up to `budget` tokens; None when it cannot
        be now (the batch is full, something was preempted this step, no KV room, an unchunked prompt)."""
        if batch.preempted or len(self.running) >= self.max_num_seqs or seq.num_pending:
            return None
        if seq.num_computed_tokens == 0 and not self.kv.has(seq.seq_id):
            cached = self.kv.get_computed_blocks(seq.seq_id, seq.all_token_ids, seq.cache_salt,
                                                 use_cache=not seq.scores_prompt)
            seq.num_computed_tokens = cached
            if seq.num_cached_tokens is None:
                seq.num_cached_tokens = cached
        n = seq.num_uncomputed_tokens
        if n > budget:
            if not self.enable_chunked_prefill:
                return None
            n = budget
        if self.kv.allocate_slots(seq.seq_id, seq.num_computed_tokens + n) is None:
            self.kv.free(seq.seq_id)  # drop the prefix hits it held; retried next step
            seq.num_computed_tokens = 0
            return None
        self.waiting.remove(seq)
        if seq.first_scheduled_time is None:
            seq.first_scheduled_time = time.time()
        # An adopted sequence arrives with its prompt's KV already in place.
        prompt_done = seq.num_computed_tokens >= len(seq.prompt_token_ids)
        seq.status = RequestStatus.DECODING if prompt_done else RequestStatus.PREFILLING
        self.running.append(seq)
        batch.seqs.append(seq)
        batch.num_new_tokens.append(n)
        return n

    def _tenants(self) -> int:
        return len({s.cache_salt for s in self.running} | {s.cache_salt for s in self.waiting})

    def _in_turn(self, seqs) -> list[Sequence]:
        """One sequence of each tenant in turn, each tenant's in their queue order; the tenant with the
        fewest sequences running goes first."""
        by_tenant: dict[str | None, list[Sequence]] = {}
        for seq in seqs:
            by_tenant.setdefault(seq.cache_salt, []).append(seq)
        if not by_tenant:
            return []
        running = Counter(s.cache_salt for s in self.running)
        queues = sorted(by_tenant.values(), key=lambda q: running[q[0].cache_salt])
        return [q[i] for i in range(max(map(len, queues))) for q in queues if i < len(q)]

    def _allocate_or_preempt(self, seq: Sequence, n: int, batch: ScheduledBatch) -> bool:
        """Make room for n more tokens of seq, preempting the newest running sequences if needed."""
        while self.kv.allocate_slots(seq.seq_id, seq.num_computed_tokens + n) is None:
            scheduled = {s.seq_id for s in batch.seqs}
            # Not one whose token is still in flight (its step's result may park or fork it): only itself.
            victim = next((s for s in reversed(self.running) if s.seq_id not in scheduled and not s.num_pending), seq)
            self.running.remove(victim)
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
