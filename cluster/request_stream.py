"""One request's stream on the client side: deltas back in order, text, stop strings, results.

Shared by the Python client and the HTTP ingress. Deltas of one sample are put back in order by their
offset (the first token comes from the prefill worker, the rest from the decode worker); text and
stop strings are computed here because workers only produce token ids.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from actors.detokenizer import IncrementalDetokenizer
from actors.request_status import RequestStatus
from actors.sampling_params import SamplingParams
from actors.token_stream import TokenDelta


@dataclass
class SampleResult:
    index: int
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    status: RequestStatus = RequestStatus.WAITING
    error: str | None = None
    num_cached_tokens: int = 0
    logprobs: list = field(default_factory=list)  # [token_id, logprob, [[id, logprob], ...]] per token

    @property
    def finish_reason(self) -> str | None:
        return self.status.finish_reason()


@dataclass
class StreamEvent:
    index: int
    token_ids: list[int]
    text: str
    finished: bool
    finish_reason: str | None
    error: str | None = None
    logprobs: list | None = None


class _Sample:
    """One sample's stream: reorders deltas by offset, detokenizes, watches for stop strings."""

    def __init__(self, index: int, detokenizer: IncrementalDetokenizer | None):
        self.result = SampleResult(index)
        self._pending: dict[int, TokenDelta] = {}
        self._detok = detokenizer

    def feed(self, delta: TokenDelta) -> list[StreamEvent]:
        if not delta.token_ids and RequestStatus(delta.status).is_finished():
            return [self._apply(delta)]  # a failure carries no tokens and ends the sample wherever it is
        self._pending[delta.offset] = delta
        events = []
        while not self.result.status.is_finished():
            d = self._pending.pop(len(self.result.token_ids), None)
            if d is None:
                break
            events.append(self._apply(d))
        return events

    def _apply(self, d: TokenDelta) -> StreamEvent:
        r = self.result
        r.token_ids.extend(d.token_ids)
        r.num_cached_tokens = d.num_cached_tokens
        if d.logprobs:
            r.logprobs.extend(d.logprobs)
        status = RequestStatus(d.status)
        text = ""
        if self._detok is not None and d.token_ids:
            out = self._detok.add_tokens(d.token_ids)
            text = out.new_text
            if out.stop_hit is not None:
                status = RequestStatus.FINISHED_STOPPED
        if status.is_finished() and self._detok is not None and self._detok.stop_hit is None:
            text += self._detok.flush()
        r.text += text
        r.status = status if status.is_finished() else RequestStatus.DECODING
        r.error = d.error
        return StreamEvent(r.index, d.token_ids, text, status.is_finished(), status.finish_reason(), d.error, d.logprobs)




class RequestStream:
    """All samples of one request; `feed` every delta that arrives, in any order."""

    def __init__(self, request_id: str, prompt_ids: list[int], params: SamplingParams, tokenizer=None):
        self.request_id = request_id
        self.prompt_token_ids = prompt_ids
        self.params = params
        self.samples = [_Sample(i, _detokenizer(tokenizer, prompt_ids, params)) for i in range(params.n)]

    @property
    def finished(self) -> bool:
        return all(s.result.status.is_finished() for s in self.samples)

    @property
    def needs_abort(self) -> bool:
        """The cluster may still be generating: unfinished, or ended here by a stop string."""
        stopped_by_text = any(s._detok is not None and s._detok.stop_hit is not None for s in self.samples)
        return not self.finished or stopped_by_text

    @property
    def results(self) -> list[SampleResult]:
        return [s.result for s in self.samples]

    def feed(self, delta: TokenDelta) -> list[StreamEvent]:
        if delta.status == RequestStatus.FAILED and not delta.token_ids:
            events = []  # a request-wide failure ends every sample
            for s in self.samples:
                if not s.result.status.is_finished():
                    events += s.feed(TokenDelta(**{**asdict(delta), "index": s.result.index}))
            return events
        return self.samples[delta.index].feed(delta)


def _detokenizer(tokenizer, prompt_ids: list[int], params: SamplingParams) -> IncrementalDetokenizer | None:
    if tokenizer is None:
        return None
    return IncrementalDetokenizer(tokenizer, prompt_ids, params.stop, params.include_stop_str_in_output,
                                  params.skip_special_tokens)
