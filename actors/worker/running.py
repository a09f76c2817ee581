"""The worker's context of an attempt (the tag of its engine record: what was asked, and when each stage
happened), and what each of its engine outputs becomes on the wire."""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

from actors.engine.outputs import RequestOutput
from actors.protocol.ids import AttemptId
from actors.protocol.messages import FirstTokenWait, StageTimes, TokenDelta, WorkerRequest
from actors.protocol.request_status import RequestStatus
from actors.worker.meter import WorkerMeter


@dataclass
class Running:
    request: WorkerRequest
    times: StageTimes
    # When this attempt's first output left here: also for a moved attempt, whose first token is not the
    # request's (`times.first_token` stays the request's, offset 0); its trace spans need it.
    first_output: float | None = None

    @property
    def attempt(self) -> AttemptId:
        """The attempt's one key: the scheduler's, the engine's and the handoff table's."""
        return self.request.attempt

    def delta(self, out: RequestOutput, meter: WorkerMeter) -> TokenDelta:
        """The token delta of one engine output; stamps travel on the first and the last delta only."""
        logprobs = _wire(out.new_logprobs)
        offset = out.num_output_tokens - len(out.new_token_ids)
        if self.first_output is None:
            self.first_output = time.time()
        times = None
        if offset == 0 or out.finished:
            if offset == 0:
                self.times = replace(self.times, scheduled=out.first_scheduled_time, first_token=time.time())
                if self.times.received is not None:  # what the scheduler's TTFT prediction is checked against
                    meter.first_token_waits.append(
                        FirstTokenWait(self.request.attempt, self.times.first_token - self.times.received))
            if out.finished:
                self.times = replace(self.times, finished=time.time())
            times = self.times
        error = out.stop_reason if out.status == RequestStatus.FAILED else None  # the engine's reason (a grammar's budget)
        return TokenDelta(self.request.attempt, out.index, offset, tuple(out.new_token_ids), out.status,
                          out.num_prompt_tokens, out.num_cached_tokens, error, logprobs, times,
                          prompt_logprobs=_wire(out.prompt_logprobs))


def _wire(entries) -> list | None:
    """Logprob entries as TokenDelta carries them: [token_id, logprob, [[id, logprob], ...]], and the rank
    after them when known (None stays None)."""
    if entries is None:
        return None
    return [None if lp is None else [lp.token_id, lp.logprob, [list(t) for t in lp.top]]
            + ([] if lp.rank is None else [lp.rank]) for lp in entries]
