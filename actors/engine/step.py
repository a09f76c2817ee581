"""One engine step: schedule, run the model, sample, post-process; one path for every step.

A synchronous step is "launch, then resolve at once"; with overlapped steps (`overlap`, in_flight.py) the
step launched is left in flight and the next call resolves it, so a step's tokens come back from the call
after the one that launched it. A step that scores prompt tokens or forks samples is resolved at once
(both need its logits on the host). Samples fork off once their prompt is computed; a sequence that hands
its KV off parks after its first token; each ends on its stop conditions (postprocess.py). What a step
changes of a request's record goes through the engine's `RequestMap` (requests.py).
"""

from __future__ import annotations

import time

import torch

from actors.engine.batcher import Batcher, ScheduledBatch
from actors.engine.in_flight import LaunchedStep, StepInputs, may_stay_in_flight, runs_blind
from actors.engine.kv.block_pool import OutOfBlocksError
from actors.engine.kv.cache_manager import KVCacheManager
from actors.engine.model.runner import ModelRunner
from actors.engine.outputs import RequestOutput, TokenLogprob
from actors.engine import prompt_scores
from actors.engine.postprocess import append_token
from actors.engine.requests import RequestMap
from actors.engine.sampling import Sampler, SampleResult, SamplingRow
from actors.engine.sequence import Sequence
from actors.engine.sequence_maker import SequenceMaker
from actors.engine.step_shape import StepShape, shape_of
from actors.protocol.request_status import RequestStatus


class Stepper:
    def __init__(self, runner: ModelRunner, kv: KVCacheManager, batcher: Batcher, sampler: Sampler,
                 make: SequenceMaker, requests: RequestMap, max_model_len: int, eos_token_ids,
                 overlap: bool):
        self.runner, self.kv, self.batcher, self.sampler = runner, kv, batcher, sampler
        self._make, self._requests = make, requests
        self.block_size = kv.block_size
        self.max_model_len = max_model_len
        self.eos_token_ids = eos_token_ids
        windows = runner.cfg.sliding_windows
        # The tokens behind a query any layer attends to; None: some layer sees the whole context.
        self.attention_span: int | None = None if None in windows else max(windows)
        self.overlap = overlap
        self.last_step_tokens = 0  # tokens computed by the latest step (for cost measurements)
        self.last_step_shape = StepShape()  # what it computed, as the capacity model sees a step
        self._in_flight: LaunchedStep | None = None  # the step launched and not yet brought back (overlap)

    @property
    def in_flight(self) -> LaunchedStep | None:
        return self._in_flight

    def step(self) -> list[RequestOutput]:
        """Schedule and run one step; returns the new tokens (and finish states) of every sequence a step
        completed. With overlapped steps (`overlap`) those are the previous step's: this one is left in
        flight, and the next call (or `has_work`'s) collects it."""
        try:
            return self._step()
        except BaseException:
            self._drop_in_flight()  # its sequences are failed by the caller; nothing may wait for it
            raise

    def _step(self) -> list[RequestOutput]:
        prev, self._in_flight = self._in_flight, None
        batch = self.batcher.schedule()
        self.last_step_tokens = batch.total_tokens
        self.last_step_shape = shape_of(batch.seqs, batch.num_new_tokens)
        if not batch.seqs and prev is None:
            return []
        started = time.perf_counter()
        if batch.seqs and self.overlap and may_stay_in_flight(batch):
            self._in_flight = self._launch(batch, prev)
            outputs = self._resolve(prev) if prev is not None else []
        else:  # a synchronous step: launch, then resolve at once
            outputs = self._resolve(prev) if prev is not None else []
            live = [(s, n) for s, n in zip(batch.seqs, batch.num_new_tokens) if not s.status.is_finished()]
            if live:  # (those the step just resolved ended have no blocks left to run on)
                step = ScheduledBatch([s for s, _ in live], [n for _, n in live], batch.preempted)
                outputs += self._resolve(self._launch(step, None))
        if batch.seqs:
            self.batcher.cost.observe(batch.total_tokens, time.perf_counter() - started)
        return outputs

    def _launch(self, batch: ScheduledBatch, prev: LaunchedStep | None) -> LaunchedStep:
        """Queue the step's forward and its draw; advance its sequences as if it had run. A step that scores
        prompt tokens or forks samples is resolved at once (`may_stay_in_flight`): both need its logits now."""
        x = StepInputs.of(batch, self.kv, prev)
        score_rows, scored = prompt_scores.score_rows(batch.seqs, batch.num_new_tokens)
        logits = self.runner.execute(x.token_ids, x.query_lens, x.computed_lens, x.tables, x.sample_rows,
                                     score_rows, feed=x.feed)
        if scored:
            prompt_scores.record(scored, logits[len(x.sample_rows):])
            logits = logits[: len(x.sample_rows)]
        before = [seq.num_computed_tokens for seq in batch.seqs]
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            seq.num_computed_tokens += n
        samplers: list[Sequence] = []
        logit_rows: list[int] = []
        for row, i in enumerate(x.sample_rows):
            seq = batch.seqs[i]
            children = []
            if seq.pending_forks:  # its prompt is computed: the children share its blocks, cached first
                self._cache_computed(seq, before[i], seq.num_computed_tokens)
                children = self._fork(seq)
            for s in [seq, *children]:
                samplers.append(s)
                logit_rows.append(row)
        if logit_rows != list(range(len(x.sample_rows))):
            logits = logits[torch.tensor(logit_rows)]
        rows = [SamplingRow(s.params, s.prompt_token_ids, s.output_token_ids, s.generator, s.grammar) for s in samplers]
        launched = LaunchedStep(list(batch.seqs), before, [s.num_computed_tokens for s in batch.seqs], samplers,
                                self.sampler.draw(logits, rows))
        for seq in samplers:
            seq.num_pending += 1
            seq.blind = runs_blind(seq, self.max_model_len)
        return launched

    def _resolve(self, step: LaunchedStep) -> list[RequestOutput]:
        """Bring a launched step's tokens to the host and apply them, as a synchronous step would have
        right after its forward. Sequences that ended meanwhile (aborted, or stopped by the token before)
        drop theirs."""
        results = step.draw.results()
        for seq, before, after in zip(step.seqs, step.computed_before, step.computed_after):
            if not seq.status.is_finished() and seq.num_computed_tokens >= after:  # not preempted since
                self._cache_computed(seq, before, after)
        outputs = []
        for seq, res in zip(step.samplers, results):
            seq.num_pending -= 1
            if not seq.status.is_finished():
                outputs.append(self._append_token(seq, res))
        return outputs

    def _drop_in_flight(self) -> None:
        """After a failed step: no token in flight will ever come (the caller fails the requests)."""
        self._in_flight = None
        for seq in self._requests.sequences():
            seq.num_pending, seq.blind = 0, False

    def _cache_computed(self, seq: Sequence, before: int, after: int) -> None:
        """A step took `seq`'s computed tokens from `before` to `after`: register the blocks it filled."""
        if after // self.block_size > before // self.block_size:
            self.kv.cache_computed(seq.seq_id, seq.all_token_ids, after, seq.cache_salt)
            self._release_outside_window(seq, after)

    def _release_outside_window(self, seq: Sequence, computed: int) -> None:
        """When every layer has a sliding window, blocks wholly older than the widest window (counted from
        the next query, at position `computed`) are never read again: hand them back. Not on a
        sequence about to hand its KV off (the receiver needs every page: it caches them all) or to fork."""
        span = self.attention_span
        if span is None or seq.hand_off or seq.pending_forks:
            return
        oldest_needed = computed - span + 1
        if oldest_needed >= self.block_size:
            self.kv.release_leading(seq.seq_id, oldest_needed // self.block_size)

    def _fork(self, parent: Sequence) -> list[Sequence]:
        """Split off the other n-1 samples once the prompt is computed; they share its full blocks."""
        children = []
        for index in range(1, parent.pending_forks + 1):
            child = self._make.new(parent.request_id, index, parent.prompt_token_ids, parent.params, parent.cache_salt)
            child.num_cached_tokens = parent.num_cached_tokens
            if self._fork_blocks(parent, child):
                child.num_computed_tokens = parent.num_computed_tokens
                child.status = RequestStatus.DECODING
                self.batcher.admit_running(child)
            else:
                # No room to fork now: the child waits and recomputes its prompt from the prefix cache.
                child.status = RequestStatus.PREEMPTED
                self.batcher.add(child, front=True)
            self._requests.forked(child)
            children.append(child)
        parent.pending_forks = 0
        return children

    def _fork_blocks(self, parent: Sequence, child: Sequence) -> bool:
        if self.batcher.load()[0] >= self.batcher.max_num_seqs:
            return False
        try:
            copy = self.kv.fork(parent.seq_id, child.seq_id, parent.num_computed_tokens)
        except OutOfBlocksError:
            return False
        if copy is not None:
            self.runner.copy_block(*copy)  # the partial prompt block each sample will write into
        return True

    def _append_token(self, seq: Sequence, res: SampleResult) -> RequestOutput:
        token = res.token_id
        record = self._requests.get(seq.request_id)
        status, new_text = append_token(seq, token, self.eos_token_ids, self.max_model_len)
        if status is None and seq.hand_off:
            seq.hand_off = False
            self.batcher.park(seq)  # out of the batch, blocks kept for the transfer
            seq.status = RequestStatus.TRANSFERRING
            self._requests.handed_off(seq)
        if status is not None:
            self.batcher.finish(seq, status)
            self._requests.sample_ended(seq)
        params = seq.params
        logprobs = None
        if params.logprobs is not None:
            logprobs = [TokenLogprob(token, res.logprob, res.top_logprobs or [])]
        # The prompt's logprobs go out once, with the first token (a fork's samples share its prompt's).
        first = seq.index == 0 and len(seq.output_token_ids) == 1
        return RequestOutput(
            seq.request_id, seq.index, [token], new_text, seq.status,
            len(seq.prompt_token_ids), seq.num_cached_tokens or 0, logprobs, seq.stop_reason,
            len(seq.output_token_ids), seq.first_scheduled_time, seq.prompt_logprobs if first else None, record.tag,
        )

