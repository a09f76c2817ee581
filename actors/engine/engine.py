"""The engine inside one worker: its requests in and out, and one step at a time.

Callers: `add_request` (raises ValueError on bad input, touching nothing else), `step` (returns the
new tokens and finish state of every sequence a step completed), `abort` (a running request; idempotent,
frees blocks at once), and the offline `generate`. For disaggregated serving: a prefill engine's request
added with `hand_off` waits HELD after its first token, its blocks held; a decode engine `reserve`s
blocks for a prompt's incoming KV and `adopt`s the request once the pages are written; `release` ends
either. The engine is single-threaded and knows nothing of Ray.

Who owns what: each request has one record (requests.py: its phase, its sequences, the caller's tag),
written only through the `RequestMap`; a step's path is step.py (overlapped steps: in_flight.py); new
sequences are built by sequence_maker.py; request checks are validation.py, stop conditions
postprocess.py, prompt logprobs prompt_scores.py, structured-output grammars structured.py.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any, Hashable, Sequence as Seq

import torch

from actors.engine.batcher import Batcher
from actors.engine.config import EngineConfig
from actors.engine.in_flight import overlap_wanted
from actors.engine.kv.cache_manager import KVCacheManager
from actors.engine.model.parallel import SINGLE, TPComm
from actors.engine.model.runner import ModelRunner
from actors.engine.outputs import CompletionOutput, EngineLoad, GenerationResult, RequestOutput
from actors.engine.requests import EngineRequest, RequestMap
from actors.protocol.handoff_phase import HandoffPhase
from actors.engine.step import Stepper
from actors.engine.sampling import Sampler
from actors.engine.sequence_maker import SequenceMaker
from actors.engine.text.tokenizer import has_tokenizer, load_tokenizer, model_eos_token_ids
from actors.engine.validation import RequestLimits, validate_request
from actors.protocol.request_status import RequestStatus
from actors.protocol.sampling_params import SamplingParams


class Engine:
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
        self.tokenizer = load_tokenizer(model_dir) if has_tokenizer(model_dir) else None
        self.eos_token_ids = model_eos_token_ids(model_dir, self.tokenizer)
        self.limits = RequestLimits(self.vocab_size, self.max_model_len, config.block_size, self.runner.num_kv_blocks,
                                    config.enable_chunked_prefill, config.max_num_batched_tokens, config.detokenize,
                                    frozenset(self.eos_token_ids))
        self.kv = KVCacheManager(
            self.runner.num_kv_blocks, config.block_size, config.enable_prefix_caching,
            model_id=config.model_id or model_dir.name,
        )
        step_budget_s = None if config.step_budget_ms is None else config.step_budget_ms / 1000
        self.batcher = Batcher(self.kv, config.max_num_seqs, config.max_num_batched_tokens, config.enable_chunked_prefill,
                               config.tenant_slowdown, step_budget_s)
        self.sampler = Sampler(self.vocab_size, self.eos_token_ids, seed=config.seed,
                               grammar_ms_per_token=config.grammar_ms_per_token)
        self._make = SequenceMaker(self.tokenizer, config.detokenize, self.vocab_size, self.sampler)
        self._requests = RequestMap()  # the one record of each request, in every phase
        self._stepper = Stepper(self.runner, self.kv, self.batcher, self.sampler, self._make, self._requests,
                                self.max_model_len, self.eos_token_ids,
                                overlap_wanted(config.overlap_steps, self.runner.device, comm.shard.size))
        self._ids = itertools.count()

    # ---- requests in ----

    def add_request(
        self,
        request_id: Hashable,
        prompt: str | Seq[int],
        params: SamplingParams | None = None,
        cache_salt: str | None = None,
        hand_off: bool = False,
        output_prefix: Seq[int] = (),
        tag: Any = None,
    ) -> None:
        """Queue a request. With `hand_off`, the prompt is computed, the first token sampled, and the
        request then waits HELD, its blocks held, until `release`. `tag`: the caller's context of
        the request, kept in its record and on each of its outputs.

        `output_prefix`: tokens this request already generated elsewhere (a migration). They are
        recomputed with the prompt, count against max_tokens, and the seeded stream skips their draws,
        so the continuation is the one a single engine would have produced."""
        params = params or SamplingParams()
        prompt_ids = self._validate(request_id, prompt, params)
        if hand_off and params.n > 1:
            raise ValueError("a request handed off to a decode worker must have n=1")
        first = self._make.new(request_id, 0, prompt_ids, params, cache_salt)
        if output_prefix:
            if params.n > 1 or hand_off:
                raise ValueError("only an n=1 request that is not handed off can resume from an output prefix")
            if len(prompt_ids) + len(output_prefix) >= self.max_model_len or len(output_prefix) >= params.max_tokens:
                raise ValueError("output_prefix leaves no room for another token (max_model_len or max_tokens)")
            self._make.resume(first, output_prefix)
        first.pending_forks = params.n - 1
        first.hand_off = hand_off
        self._requests.add(EngineRequest(request_id, HandoffPhase.RUNNING, [first], tag=tag))
        self.batcher.add(first)

    def reserve(self, request_id: Hashable, num_tokens: int, tag: Any = None) -> list[int] | None:
        """Decode role: allocate blocks for `num_tokens` of a prompt's KV that another worker computes; None
        if they do not fit now. The request waits RESERVED until `adopt` or `release`."""
        if request_id in self._requests:
            raise ValueError(f"request_id {request_id!r} is already in the engine")
        if not 0 < num_tokens < self.max_model_len:
            raise ValueError(f"cannot reserve {num_tokens} tokens with max_model_len={self.max_model_len}")
        record = EngineRequest(request_id, HandoffPhase.RESERVED, reserved_tokens=num_tokens, tag=tag)
        if self.kv.allocate_slots(record.blocks_id, num_tokens) is None:
            self.kv.free(record.blocks_id)
            return None
        self._requests.add(record)
        return list(self.kv.block_table(record.blocks_id))

    def adopt(self, request_id: Hashable, prompt_ids: list[int], first_token: int, params: SamplingParams,
              cache_salt: str | None = None, num_cached_tokens: int = 0) -> None:
        """Continue a RESERVED request whose prompt KV was written into its blocks elsewhere, after the
        first token the other worker drew. Raises ValueError, the reservation kept, if it does not fit."""
        record = self._requests.get(request_id)
        reserved = record.reserved_tokens if record is not None and record.phase is HandoffPhase.RESERVED else None
        if reserved != len(prompt_ids):
            raise ValueError(f"request {request_id!r}: {reserved} tokens reserved, {len(prompt_ids)} adopted")
        params.validate_token_ids(self.vocab_size)
        seq = self._make.new(request_id, 0, list(prompt_ids), params, cache_salt)
        self._make.resume(seq, [first_token])  # drawn, and its text emitted, by the prefill side
        seq.num_computed_tokens = len(prompt_ids)
        seq.num_cached_tokens = num_cached_tokens
        self.kv.cache_computed(seq.seq_id, prompt_ids, len(prompt_ids), cache_salt)
        self._requests.adopted(request_id, seq)
        self.batcher.add(seq)

    def _validate(self, request_id: Hashable, prompt: str | Seq[int], params: SamplingParams) -> list[int]:
        if request_id is None or request_id == "":
            raise ValueError("request_id must be a non-empty string or another hashable key")
        if request_id in self._requests:
            raise ValueError(f"request_id {request_id!r} is already in the engine")
        return validate_request(self.limits, self.tokenizer, prompt, params)

    # ---- requests out ----

    def abort(self, request_id: Hashable) -> bool:
        """Cancel every sample of a running request and free its blocks now; False if none is here. The
        blocks of a request RESERVED or HELD are a lease: its owner ends it with `release`."""
        record = self._requests.pop(request_id, (HandoffPhase.RUNNING,))
        if record is None:
            return False
        for seq in record.seqs:
            self.batcher.finish(seq, RequestStatus.CANCELLED)
        return True

    def release(self, request_id: Hashable) -> EngineRequest | None:
        """End a RESERVED or HELD request and free its blocks (a handed-off prompt's stay cached);
        the record ended, or None (idempotent)."""
        record = self._requests.pop(request_id, (HandoffPhase.RESERVED, HandoffPhase.HELD))
        if record is None:
            return None
        self.kv.free(record.blocks_id)
        for seq in record.seqs:
            seq.status = RequestStatus.FINISHED_STOPPED
        return record

    # ---- the records ----

    def has_unfinished(self) -> bool:
        return bool(self._requests)

    def has_work(self) -> bool:
        """Whether `step` would compute anything or bring a step in flight back (handed-off and reserved
        requests only wait)."""
        return self.batcher.has_unfinished() or self._stepper.in_flight is not None

    def is_live(self, request_id: Hashable) -> bool:
        return request_id in self._requests

    def phase(self, request_id: Hashable) -> HandoffPhase | None:
        record = self._requests.get(request_id)
        return None if record is None else record.phase

    def tag(self, request_id: Hashable) -> Any:
        record = self._requests.get(request_id)
        return None if record is None else record.tag

    def tags(self) -> list[tuple[HandoffPhase, Any]]:
        """(phase, tag) of every request here."""
        return [(record.phase, record.tag) for record in self._requests.records()]

    def grammar_ready(self, params: SamplingParams) -> bool:
        """The request needs no grammar compile to start: it has no structured output, or it is compiled."""
        spec = params.structured_output
        grammars = self.sampler.grammars
        return spec is None or (grammars is not None and grammars.ready(spec))

    def compile_grammar(self, params: SamplingParams) -> None:
        """Compile the request's structured output for a later `add_request`, `reserve` or `adopt` (any
        thread; GrammarError names what does not compile)."""
        if params.structured_output is not None:
            self._make.grammars().compile(params.structured_output)

    def reset_prefix_cache(self) -> bool:
        """Drop every cached prefix and the KV events not yet taken; False (nothing changes) while a request
        holds blocks. For a worker that changes role: the scheduler knows its cache under its old id only."""
        if self._requests or not self.kv.reset_prefix_cache():
            return False
        self.kv.take_events()
        return True

    def holding(self) -> list[Hashable]:
        """The requests RESERVED or HELD: their blocks are a lease (`release` ends it)."""
        return [record.request_id for record in self._requests.records() if record.phase is not HandoffPhase.RUNNING]

    def lease_blocks(self, request_id: Hashable) -> list[int]:
        """The blocks of a RESERVED or HELD request, in prompt order; [] for any other."""
        record = self._requests.get(request_id)
        if record is None or record.phase is HandoffPhase.RUNNING:
            return []
        return list(self.kv.block_table(record.blocks_id))

    # ---- one step ----

    def step(self) -> list[RequestOutput]:
        """Schedule and run one step (step.py); returns the new tokens (and finish states) of every
        sequence a step completed. With overlapped steps (`overlap`) those are the previous step's: this
        one is left in flight, and the next call (or `has_work`'s) collects it."""
        return self._stepper.step()

    @property
    def overlap(self) -> bool:
        return self._stepper.overlap

    @property
    def last_step_tokens(self) -> int:
        """Tokens computed by the latest step (for cost measurements)."""
        return self._stepper.last_step_tokens

    @property
    def last_step_shape(self):
        """What the latest step computed (a `StepShape`: prefill tokens, pairs, samples; decodes, context)."""
        return self._stepper.last_step_shape

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
            prompt_ids = self._requests.get(request_id).seqs[0].prompt_token_ids
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
        self.sampler.check_integrity()
        in_flight = self._stepper.in_flight
        launched = in_flight.pending_counts() if in_flight is not None else {}
        wrong = [s.seq_id for s in self._requests.sequences() if s.num_pending != launched.get(id(s), 0)]
        if wrong:
            raise RuntimeError(f"{len(wrong)} sequences count other pending tokens than the step in flight will "
                               f"bring (e.g. {wrong[0]})")
        running = [r for r in self._requests.records() if r.phase is HandoffPhase.RUNNING]
        live = {s.seq_id for r in running for s in r.seqs if not s.status.is_finished()}
        queued = self.batcher.queued_ids()
        if live != queued:
            raise RuntimeError(f"engine tracks {len(live)} live sequences but the batcher queues {len(queued)}")
        for record in self._requests.records():
            if record.phase is not HandoffPhase.RUNNING and not self.kv.has(record.blocks_id):
                raise RuntimeError(f"request {record.request_id!r} is {record.phase.value} and holds no blocks")
            if record.phase is HandoffPhase.HELD and record.seqs[0].status is not RequestStatus.TRANSFERRING:
                raise RuntimeError(f"handed-off request {record.request_id!r} is {record.seqs[0].status}")

    def take_kv_events(self) -> list:
        return self.kv.take_events()

    def attach_tier(self, tier) -> None:
        """A host KV tier below the prefix cache (kv/host_tier.py), or None to detach it; between steps only."""
        self.kv.attach_tier(tier)

    def load(self) -> EngineLoad:
        running, waiting = self.batcher.load()
        pool = self.kv.pool
        by_tenant = self.batcher.queued_prefill_by_tenant()
        return EngineLoad(pool.num_free_blocks, pool.num_blocks, pool.num_used_blocks, running, waiting,
                          sum(by_tenant.values()), self.batcher.num_preemptions, by_tenant)

    def longest_remaining_tokens(self) -> int:
        """The most tokens any sequence here may still generate (its max_tokens less what it has): how
        many steps a drain may take at worst (an answer can end sooner, at a stop)."""
        return max((max(seq.params.max_tokens - len(seq.output_token_ids), 0) for seq in self._requests.sequences()),
                   default=0)

    def prompts_pending(self) -> bool:
        """Some request still has prompt tokens to compute (waiting, or mid-prefill)."""
        return self.batcher.queued_prefill_tokens() > 0

    @property
    def num_used_blocks(self) -> int:
        return self.kv.pool.num_used_blocks

    # What the KV transport and cost models read of the model (never to allocate blocks): the runner's.

    @property
    def model_config(self):
        return self.runner.cfg

    @property
    def dtype(self) -> torch.dtype:
        return self.runner.dtype

    @property
    def kv_caches(self):
        return self.runner.kv_caches

    @property
    def num_kv_blocks(self) -> int:
        return self.runner.num_kv_blocks

    @property
    def bytes_per_block(self) -> int:
        """KV bytes of one block in this process (a tensor-parallel rank's share of the model's)."""
        return self.runner.bytes_per_block

    @property
    def model_bytes_per_block(self) -> int:
        """KV bytes of one block of the whole model (every rank's heads; a replicated head once)."""
        total, by_rank = self.kv_heads
        return self.bytes_per_block * total // (by_rank[0][1] - by_rank[0][0])

    @property
    def kv_heads(self) -> tuple[int, tuple[tuple[int, int], ...]]:
        """The model's KV head count, and which of them ([first, end)) each tensor-parallel rank's cache holds."""
        return self.runner.model.total_kv_heads, self.runner.model.kv_heads_by_rank
