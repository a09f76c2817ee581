"""The engine inside one worker: schedule -> run the model -> sample and post-process, once per step.

Callers: `add_request` (raises ValueError on bad input, touching nothing else), `step` (returns the
new tokens and finish state of every sequence a step completed), `abort` (idempotent, frees blocks at
once), and the offline `generate`. The engine is single-threaded and knows nothing of Ray.

With overlapped steps (`overlap`, in_flight.py) `step` launches the next step before it brings the
previous one back: a step's tokens are returned by the call after the one that launched it, and
`has_work` stays true while a step is in flight.

Why one file of ~400 lines: it is the one owner of a worker's requests and sequences (forks, window
releases and the step in flight included); the hand-off and adoption of disaggregated serving
(`disaggregation.py`), what it reports of its cache and model (`engine_views.py`), a step's inputs and
which sequences run blind (`in_flight.py`), stop conditions (`postprocess.py`), request checks
(`validation.py`), prompt logprobs (`prompt_scores.py`) and structured-output grammars (`structured.py`)
live beside it.
"""

from __future__ import annotations

import itertools
import time
from pathlib import Path
from typing import Sequence as Seq

import torch

from actors.engine.batcher import Batcher, ScheduledBatch
from actors.engine.config import EngineConfig
from actors.engine.disaggregation import Disaggregation
from actors.engine.engine_views import EngineViews
from actors.engine.in_flight import LaunchedStep, StepInputs, may_stay_in_flight, overlap_wanted, runs_blind
from actors.engine.kv.block_pool import OutOfBlocksError
from actors.engine.kv.cache_manager import KVCacheManager
from actors.engine.model.parallel import SINGLE, TPComm
from actors.engine.model.runner import ModelRunner
from actors.engine.outputs import CompletionOutput, GenerationResult, RequestOutput, TokenLogprob
from actors.engine import prompt_scores
from actors.engine.postprocess import append_token
from actors.engine.sampling import Sampler, SampleResult, SamplingRow, skip_draws
from actors.engine.sequence import Sequence
from actors.engine.structured import Grammars
from actors.engine.text.detokenizer import IncrementalDetokenizer
from actors.engine.text.tokenizer import has_tokenizer, load_tokenizer, model_eos_token_ids
from actors.engine.validation import RequestLimits, validate_request
from actors.protocol.request_status import RequestStatus
from actors.protocol.sampling_params import SamplingParams


class Engine(Disaggregation, EngineViews):
    def __init__(self, config: EngineConfig, comm: TPComm = SINGLE):
        """`comm`: rank 0 of a tensor-parallel worker's group (the engine leads; see ModelRunner)."""
        self.config = config
        model_dir = Path(config.model)
        self.runner = ModelRunner.from_config(config, comm)
        self.vocab_size = self.runner.cfg.vocab_size
        self.max_model_len = config.max_model_len or self.runner.cfg.max_position_embeddings
        if self.max_model_len > self.runner.cfg.max_position_embeddings:
            raise ValueError(
                f"max_model_len={self.max_model_len} exceeds the model's max_position_embeddings="
                f"{self.runner.cfg.max_position_embeddings}"
            )
        windows = self.runner.cfg.sliding_windows
        # The tokens behind a query any layer attends to; None: some layer sees the whole context.
        self.attention_span: int | None = None if None in windows else max(windows)
        self.tokenizer = load_tokenizer(model_dir) if has_tokenizer(model_dir) else None
        self.eos_token_ids = model_eos_token_ids(model_dir, self.tokenizer)
        self.limits = RequestLimits(self.vocab_size, self.max_model_len, config.block_size, self.runner.num_kv_blocks,
                                    config.enable_chunked_prefill, config.max_num_batched_tokens, config.detokenize,
                                    frozenset(self.eos_token_ids))
        self.kv = KVCacheManager(
            self.runner.num_kv_blocks, config.block_size, config.enable_prefix_caching,
            model_id=config.model_id or model_dir.name,
        )
        self.batcher = Batcher(self.kv, config.max_num_seqs, config.max_num_batched_tokens, config.enable_chunked_prefill,
                               config.tenant_slowdown)
        self.sampler = Sampler(self.vocab_size, self.eos_token_ids, seed=config.seed)
        self._requests: dict[str, list[Sequence]] = {}
        self._handoffs: dict[str, Sequence] = {}  # prefill role: KV held for a decode worker
        self._reservations: dict[str, int] = {}  # decode role: blocks reserved for incoming KV
        self._ids = itertools.count()
        self.last_step_tokens = 0  # tokens computed by the latest step (for cost measurements)
        self.overlap = overlap_wanted(config.overlap_steps, self.runner.device, comm.shard.size)
        self._in_flight: LaunchedStep | None = None  # the step launched and not yet brought back (overlap)

    # ---- requests in ----

    def add_request(
        self,
        request_id: str,
        prompt: str | Seq[int],
        params: SamplingParams | None = None,
        cache_salt: str | None = None,
        hand_off: bool = False,
        output_prefix: Seq[int] = (),
    ) -> None:
        """Queue a request. With `hand_off`, the prompt is computed, the first token sampled, and the
        sequence then waits as TRANSFERRING, its blocks held, until `release_handoff`.

        `output_prefix`: tokens this request already generated elsewhere (a migration). They are
        recomputed with the prompt, count against max_tokens, and the seeded stream skips their draws,
        so the continuation is the one a single engine would have produced."""
        params = params or SamplingParams()
        prompt_ids = self._validate(request_id, prompt, params)
        if hand_off and params.n > 1:
            raise ValueError("a request handed off to a decode worker must have n=1")
        first = self._new_sequence(request_id, 0, prompt_ids, params, cache_salt)
        if output_prefix:
            if params.n > 1 or hand_off:
                raise ValueError("only an n=1 request that is not handed off can resume from an output prefix")
            if len(prompt_ids) + len(output_prefix) >= self.max_model_len or len(output_prefix) >= params.max_tokens:
                raise ValueError("output_prefix leaves no room for another token (max_model_len or max_tokens)")
            if any(not isinstance(t, int) or not 0 <= t < self.vocab_size for t in output_prefix):
                raise ValueError(f"output_prefix holds a token id outside the vocabulary [0, {self.vocab_size})")
            first.output_token_ids.extend(output_prefix)
            if first.grammar is not None and not all(first.grammar.accept(t) for t in output_prefix):
                raise ValueError("output_prefix does not match the request's structured output")
            if first.generator is not None:
                skip_draws(first.generator, params, len(output_prefix))
            if first.detokenizer is not None:
                first.detokenizer.add_tokens(list(output_prefix))  # already streamed by the lost worker
        first.pending_forks = params.n - 1
        first.hand_off = hand_off
        self._requests[request_id] = [first]
        self.batcher.add(first)

    def _validate(self, request_id: str, prompt: str | Seq[int], params: SamplingParams) -> list[int]:
        if not isinstance(request_id, str) or not request_id:
            raise ValueError("request_id must be a non-empty string")
        if request_id in self._requests:
            raise ValueError(f"request_id {request_id!r} is already in the engine")
        return validate_request(self.limits, self.tokenizer, prompt, params)

    def _new_sequence(self, request_id, index, prompt_ids, params, cache_salt) -> Sequence:
        generator = None
        if params.seed is not None:
            # Sample i of a seeded request draws from its own stream, whatever else is in the batch.
            generator = torch.Generator().manual_seed(params.seed + index)
        detok = None
        if self.tokenizer is not None and self.config.detokenize:
            detok = IncrementalDetokenizer(
                self.tokenizer, prompt_ids, params.stop, params.include_stop_str_in_output, params.skip_special_tokens
            )
        seq = Sequence(request_id, index, prompt_ids, params, cache_salt, generator, detok)
        seq.grammar = self._grammar(params)
        return seq

    def _grammar(self, params: SamplingParams):
        """A fresh walk of the request's structured-output grammar (None without one)."""
        if params.structured_output is None:
            return None
        if self.sampler.grammars is None:
            if self.tokenizer is None:
                raise ValueError("structured output needs the model's tokenizer, and this model directory has none")
            self.sampler.grammars = Grammars(self.tokenizer, self.vocab_size)
        return self.sampler.grammars.start(params.structured_output)

    def abort(self, request_id: str) -> bool:
        """Cancel every sample of a request and free its blocks now; False if it is not here. A
        reservation is not a request: its owner ends it with `release_reservation`."""
        seqs = self._requests.get(request_id)
        if seqs is None:
            return False
        self.release_handoff(request_id)
        self._requests.pop(request_id, None)
        for seq in seqs:
            self.batcher.finish(seq, RequestStatus.CANCELLED)
        return True

    def has_unfinished(self) -> bool:
        return bool(self._requests)

    def has_work(self) -> bool:
        """Whether `step` would compute anything or bring a step in flight back (handed-off requests only
        wait for a release)."""
        return self.batcher.has_unfinished() or self._in_flight is not None

    def is_live(self, request_id: str) -> bool:
        return request_id in self._requests

    # ---- one step ----

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
        prev = self._in_flight
        batch = self.batcher.schedule()
        self.last_step_tokens = batch.total_tokens
        if not batch.seqs and prev is None:
            return []
        started = time.perf_counter()
        if batch.seqs and self.overlap and may_stay_in_flight(batch):
            self._in_flight = self._launch(batch, prev)
            outputs = self._resolve(prev) if prev is not None else []
        else:
            self._in_flight = None
            outputs = self._resolve(prev) if prev is not None else []
            live = [(s, n) for s, n in zip(batch.seqs, batch.num_new_tokens) if not s.status.is_finished()]
            if live:  # (those the step just resolved ended have no blocks left to run on)
                outputs += self._run(ScheduledBatch([s for s, _ in live], [n for _, n in live], batch.preempted))
        if batch.seqs:
            self.batcher.cost.observe(batch.total_tokens, time.perf_counter() - started)
        return outputs

    def _launch(self, batch: ScheduledBatch, prev: LaunchedStep | None) -> LaunchedStep:
        """Queue the step's forward and its draw; advance its sequences as if it had run."""
        x = StepInputs.of(batch, self.kv, prev)
        logits = self.runner.execute(x.token_ids, x.query_lens, x.computed_lens, x.tables, x.sample_rows, feed=x.feed)
        before = [seq.num_computed_tokens for seq in batch.seqs]
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            seq.num_computed_tokens += n
        samplers = [batch.seqs[i] for i in x.sample_rows]
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
        for seq in (s for seqs in self._requests.values() for s in seqs):
            seq.num_pending, seq.blind = 0, False

    def _run(self, batch: ScheduledBatch) -> list[RequestOutput]:
        """A synchronous step: forward, sample and post-process before returning."""
        x = StepInputs.of(batch, self.kv, None)
        sample_rows = x.sample_rows
        score_rows, scored = prompt_scores.score_rows(batch.seqs, batch.num_new_tokens)
        logits = self.runner.execute(x.token_ids, x.query_lens, x.computed_lens, x.tables, sample_rows, score_rows)
        if scored:
            prompt_scores.record(scored, logits[len(sample_rows):])
            logits = logits[: len(sample_rows)]

        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            seq.num_computed_tokens += n
            self._cache_computed(seq, seq.num_computed_tokens - n, seq.num_computed_tokens)

        samplers: list[Sequence] = []
        logit_rows: list[int] = []
        for row, i in enumerate(sample_rows):
            seq = batch.seqs[i]
            for s in [seq, *self._fork(seq)]:
                samplers.append(s)
                logit_rows.append(row)
        rows = [SamplingRow(s.params, s.prompt_token_ids, s.output_token_ids, s.generator, s.grammar) for s in samplers]
        if logit_rows != list(range(len(sample_rows))):
            logits = logits[torch.tensor(logit_rows)]
        results = self.sampler(logits, rows)
        return [self._append_token(seq, res) for seq, res in zip(samplers, results)]

    def _cache_computed(self, seq: Sequence, before: int, after: int) -> None:
        """A step took `seq`'s computed tokens from `before` to `after`: register the blocks it filled."""
        if after // self.config.block_size > before // self.config.block_size:
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
        if oldest_needed >= self.config.block_size:
            self.kv.release_leading(seq.seq_id, oldest_needed // self.config.block_size)

    def _fork(self, parent: Sequence) -> list[Sequence]:
        """Split off the other n-1 samples once the prompt is computed; they share its full blocks."""
        children = []
        for index in range(1, parent.pending_forks + 1):
            child = self._new_sequence(parent.request_id, index, parent.prompt_token_ids, parent.params, parent.cache_salt)
            child.num_cached_tokens = parent.num_cached_tokens
            if self._fork_blocks(parent, child):
                child.num_computed_tokens = parent.num_computed_tokens
                child.status = RequestStatus.DECODING
                self.batcher.admit_running(child)
            else:
                # No room to fork now: the child waits and recomputes its prompt from the prefix cache.
                child.status = RequestStatus.PREEMPTED
                self.batcher.add(child, front=True)
            self._requests[parent.request_id].append(child)
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
        status, new_text = append_token(seq, token, self.eos_token_ids, self.max_model_len)
        if status is None and seq.hand_off:
            seq.hand_off = False
            self.batcher.park(seq)  # out of the batch, blocks kept for the transfer
            seq.status = RequestStatus.TRANSFERRING
            self._handoffs[seq.request_id] = seq
        if status is not None:
            self.batcher.finish(seq, status)
            self._forget_if_done(seq.request_id)
        params = seq.params
        logprobs = None
        if params.logprobs is not None:
            logprobs = [TokenLogprob(token, res.logprob, res.top_logprobs or [])]
        # The prompt's logprobs go out once, with the first token (a fork's samples share its prompt's).
        first = seq.index == 0 and len(seq.output_token_ids) == 1
        return RequestOutput(
            seq.request_id, seq.index, [token], new_text, seq.status,
            len(seq.prompt_token_ids), seq.num_cached_tokens or 0, logprobs, seq.stop_reason,
            len(seq.output_token_ids), seq.first_scheduled_time, seq.prompt_logprobs if first else None,
        )

    def _forget_if_done(self, request_id: str) -> None:
        seqs = self._requests.get(request_id)
        if seqs is not None and not seqs[0].pending_forks and all(s.status.is_finished() for s in seqs):
            del self._requests[request_id]

    # ---- offline ----

    def generate(
        self,
        prompts: Seq[str] | Seq[Seq[int]],
        params: SamplingParams | Seq[SamplingParams] | None = None,
    ) -> list[GenerationResult]:
        """Run prompts to completion; results in prompt order."""
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} sampling params for {len(prompts)} prompts")
        results: dict[str, GenerationResult] = {}
        for prompt, p in zip(prompts, params):
            request_id = f"gen-{next(self._ids)}"
            try:
                self.add_request(request_id, prompt, p)
            except ValueError:
                for added in results:  # all or nothing: no orphaned requests keep running
                    self.abort(added)
                raise
            prompt_ids = self._requests[request_id][0].prompt_token_ids
            results[request_id] = GenerationResult(request_id, prompt_ids, [CompletionOutput(i) for i in range(p.n)])
        pending = set(results)
        while pending:
            for out in self.step():
                if out.request_id in results:
                    results[out.request_id].absorb(out)
            pending = {r for r in pending if r in self._requests}
        return list(results.values())

    # ---- introspection ----

    def check_integrity(self) -> None:
        self.batcher.check_integrity()
        launched = self._in_flight.pending_counts() if self._in_flight is not None else {}
        wrong = [s.seq_id for seqs in self._requests.values() for s in seqs if s.num_pending != launched.get(id(s), 0)]
        if wrong:
            raise RuntimeError(f"{len(wrong)} sequences count other pending tokens than the step in flight will "
                               f"bring (e.g. {wrong[0]})")
        live = {s.seq_id for seqs in self._requests.values() for s in seqs if not s.status.is_finished()}
        queued = self.batcher.queued_ids()
        queued |= {s.seq_id for s in self._handoffs.values()}
        if live != queued:
            raise RuntimeError(f"engine tracks {len(live)} live sequences but the batcher queues {len(queued)}")

    def take_kv_events(self) -> list:
        return self.kv.take_events()
