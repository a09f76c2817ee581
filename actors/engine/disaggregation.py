"""Disaggregated serving's half of the Engine: a prefill engine hands a request's prompt KV off, a
decode engine reserves blocks for incoming KV and adopts the request once the pages have landed.

A base class of `Engine` (engine.py), not an object of its own: these methods change the same requests,
sequences and blocks the engine owns (`_requests`, `_handoffs`, `_reservations`, `kv`, `batcher`), and a
second owner of them would break the one-owner rule.
"""

from __future__ import annotations

from actors.engine.sampling import skip_draws
from actors.protocol.request_status import RequestStatus
from actors.protocol.sampling_params import SamplingParams


class Disaggregation:
    def handoff_blocks(self, request_id: str) -> list[int]:
        """The blocks holding a TRANSFERRING request's prompt KV, in prompt order."""
        seq = self._handoffs[request_id]
        return list(self.kv.block_table(seq.seq_id))

    def release_handoff(self, request_id: str) -> bool:
        """Drop the hold on a handed-off request's blocks (they stay cached); idempotent."""
        seq = self._handoffs.pop(request_id, None)
        if seq is None:
            return False
        self.kv.free(seq.seq_id)
        seq.status = RequestStatus.FINISHED_STOPPED
        self._requests.pop(request_id, None)
        return True

    def reserve(self, request_id: str, num_tokens: int) -> list[int] | None:
        """Allocate blocks for `num_tokens` of incoming prompt KV; None if they do not fit now."""
        if request_id in self._requests or request_id in self._reservations:
            raise ValueError(f"request_id {request_id!r} is already in the engine")
        if not 0 < num_tokens < self.max_model_len:
            raise ValueError(f"cannot reserve {num_tokens} tokens with max_model_len={self.max_model_len}")
        if self.kv.allocate_slots((request_id, 0), num_tokens) is None:
            self.kv.free((request_id, 0))
            return None
        self._reservations[request_id] = num_tokens
        return list(self.kv.block_table((request_id, 0)))

    def reserved_blocks(self, request_id: str) -> tuple[int, ...]:
        """The blocks reserved for `request_id`'s incoming KV; () if it has no reservation."""
        if request_id not in self._reservations:
            return ()
        return tuple(self.kv.block_table((request_id, 0)))

    def release_reservation(self, request_id: str) -> bool:
        """Free a reservation whose KV never came (or whose request failed); idempotent."""
        if self._reservations.pop(request_id, None) is None:
            return False
        self.kv.free((request_id, 0))
        return True

    def adopt(
        self,
        request_id: str,
        prompt_ids: list[int],
        first_token: int,
        params: SamplingParams,
        cache_salt: str | None = None,
        num_cached_tokens: int = 0,
    ) -> None:
        """Continue a request whose prompt KV was written into its reserved blocks elsewhere."""
        reserved = self._reservations.get(request_id)
        if reserved != len(prompt_ids):
            raise ValueError(f"request {request_id!r}: {reserved} tokens reserved, {len(prompt_ids)} adopted")
        params.validate_token_ids(self.vocab_size)
        del self._reservations[request_id]
        seq = self._new_sequence(request_id, 0, list(prompt_ids), params, cache_salt)
        seq.output_token_ids.append(first_token)
        if seq.grammar is not None and not seq.grammar.accept(first_token):  # its walk continues from here
            raise ValueError(f"request {request_id!r}: the first token does not match its structured output")
        seq.num_computed_tokens = len(prompt_ids)
        seq.num_cached_tokens = num_cached_tokens
        if seq.generator is not None:
            skip_draws(seq.generator, params, 1)  # the first token was drawn on the prefill worker
        if seq.detokenizer is not None:
            seq.detokenizer.add_tokens([first_token])  # its text was emitted by the prefill side
        self.kv.cache_computed(seq.seq_id, prompt_ids, len(prompt_ids), cache_salt)
        self._requests[request_id] = [seq]
        self.batcher.add(seq)

