"""Turning a request into the sequences the engine schedules: a sample's seeded generator, its
incremental detokenizer and its structured-output walk, and a sequence that resumes after tokens
generated elsewhere (a migration's output prefix, or the first token a prefill worker drew).

The engine (engine.py) decides when a sequence is made and keeps it; this only builds it, so every way
a sequence starts (a new request, a fork, an adoption, a migration) starts it the same way.
"""

from __future__ import annotations

import threading
from typing import Hashable, Sequence as Seq

import torch

from actors.engine.sampling import Sampler, skip_draws
from actors.engine.sequence import Sequence
from actors.engine.structured import Grammars
from actors.engine.text.detokenizer import IncrementalDetokenizer
from actors.protocol.sampling_params import SamplingParams


class SequenceMaker:
    def __init__(self, tokenizer, detokenize: bool, vocab_size: int, sampler: Sampler):
        self._tokenizer = tokenizer
        self._detokenize = detokenize
        self._vocab_size = vocab_size
        self._sampler = sampler  # its grammars are made on the first request that asks for structured output
        self._grammars_made = threading.Lock()

    def new(self, request_id: Hashable, index: int, prompt_ids: list[int], params: SamplingParams,
            cache_salt: str | None) -> Sequence:
        generator = None
        if params.seed is not None:
            # Sample i of a seeded request draws from its own stream, whatever else is in the batch.
            generator = torch.Generator().manual_seed(params.seed + index)
        detok = None
        if self._tokenizer is not None and self._detokenize:
            detok = IncrementalDetokenizer(
                self._tokenizer, prompt_ids, params.stop, params.include_stop_str_in_output, params.skip_special_tokens
            )
        seq = Sequence(request_id, index, prompt_ids, params, cache_salt, generator, detok)
        seq.grammar = self._grammar(params)
        return seq

    def resume(self, seq: Sequence, generated: Seq[int]) -> None:
        """Continue `seq` after tokens generated elsewhere (already streamed to the client): they join its
        output, its grammar walks them, its seeded stream skips their draws and its text does not repeat
        them, so the continuation is the one a single engine would have produced. Raises ValueError, with
        the sequence unusable, when they cannot be its output."""
        if any(not isinstance(t, int) or not 0 <= t < self._vocab_size for t in generated):
            raise ValueError(f"output_prefix holds a token id outside the vocabulary [0, {self._vocab_size})")
        seq.output_token_ids.extend(generated)
        if seq.grammar is not None and not all(seq.grammar.accept(t) for t in generated):
            raise ValueError("the tokens generated before do not match the request's structured output")
        if seq.generator is not None:
            skip_draws(seq.generator, seq.params, len(generated))
        if seq.detokenizer is not None:
            seq.detokenizer.add_tokens(list(generated))

    def _grammar(self, params: SamplingParams):
        """A fresh walk of the request's structured-output grammar (None without one)."""
        if params.structured_output is None:
            return None
        return self.grammars().start(params.structured_output)

    def grammars(self) -> Grammars:
        """The engine's grammar compiler, made on first use (any thread: a worker compiles off its engine
        thread)."""
        with self._grammars_made:
            if self._sampler.grammars is None:
                if self._tokenizer is None:
                    raise ValueError("structured output needs the model's tokenizer, and this model directory has none")
                self._sampler.grammars = Grammars(self._tokenizer, self._vocab_size, self._sampler.grammar_ms_per_token)
            return self._sampler.grammars
