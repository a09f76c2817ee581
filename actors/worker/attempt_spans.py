"""A worker's spans of its attempts (tracing on), children of the scheduler's span that placed them:

- `tandem.prefill`: the prompt computed here, from the attempt's arrival to its first token (on a prefill
  worker: to the end of its KV send, which is its child `tandem.kv_send`, bytes and destination);
- `tandem.kv_adopt` (decode worker): from the send's start to the adoption of the landed pages, child of
  the sender's `tandem.kv_send` (its context rides the handoff note);
- `tandem.decode`: from the first token (or the adoption) to the attempt's end, finished or aborted.

All but the send are recorded once a stage has ended, from the attempt's stage stamps (`Running.times`);
nothing is recorded per token or per step. Called on the engine thread only.
"""

from __future__ import annotations

import time

from actors.protocol.messages import KvDestination
from actors.protocol.request_status import RequestStatus
from actors.tracing.spans import context_of, ns, record, trace_of
from actors.worker.running import Running


class AttemptSpans:
    def __init__(self, tracer, worker_id: str, role: str, transport: str):
        self._tracer, self._worker, self._role, self._transport = tracer, worker_id, role, transport

    def _attributes(self, run: Running) -> dict:
        request = run.request.request
        return {"tandem.request_id": request.request_id, "tandem.attempt": str(run.attempt),
                "tandem.tenant": request.cache_salt or "", "tandem.worker_id": self._worker,
                "tandem.worker_role": self._role, "tandem.prompt_tokens": len(request.prompt_token_ids)}

    def sending(self, run: Running, cached_tokens: int, dest: KvDestination, nbytes: int):
        """A prefill's span and its KV send's, both open until `sent` (None, None: tracing off)."""
        if self._tracer is None:
            return None, None
        times = run.times
        prefill = self._tracer.start_span("tandem.prefill", context=context_of(run.request.request.trace),
                                          start_time=ns(times.received or time.time()),
                                          attributes={**self._attributes(run), "tandem.cached_tokens": cached_tokens})
        for event, stamp in (("scheduled", times.scheduled), ("first_token", times.first_token or run.first_output)):
            if stamp is not None:
                prefill.add_event(event, timestamp=ns(stamp))
        from opentelemetry import trace

        send = self._tracer.start_span("tandem.kv_send", context=trace.set_span_in_context(prefill), attributes={
            "tandem.request_id": run.request.request.request_id, "tandem.worker_id": self._worker,
            "tandem.decode_worker": dest.decode_worker, "tandem.kv_bytes": nbytes,
            "tandem.kv_blocks": len(dest.reservation.block_ids), "tandem.transport": self._transport})
        return prefill, send

    @staticmethod
    def trace(send):
        """What the handoff note carries for the decode worker's adopt span."""
        return None if send is None else trace_of(send)

    @staticmethod
    def sent(prefill, send, error: str | None = None) -> None:
        if send is None:
            return
        if error is not None:
            from opentelemetry.trace import Status, StatusCode

            send.set_status(Status(StatusCode.ERROR, error))
        send.end()
        prefill.end()

    def adopted(self, run: Running, note_trace, prefill_worker: str, nbytes: int) -> None:
        """The pages of a handoff landed and were adopted (decode worker)."""
        if self._tracer is None:
            return
        times = run.times
        record(self._tracer, "tandem.kv_adopt", note_trace, times.sent or times.landed, times.adopted,
               {**self._attributes(run), "tandem.prefill_worker": prefill_worker, "tandem.kv_bytes": nbytes,
                "tandem.transport": self._transport}, [("landed", times.landed)])

    def ended(self, run: Running | None, status: RequestStatus, output_tokens: int | None = None,
              cached_tokens: int | None = None, error: str | None = None) -> None:
        """The attempt ended here (finished, aborted or failed): its prefill span if the prompt was computed
        here and not yet recorded, and its decode span if it had a first token."""
        if self._tracer is None or run is None:
            return
        times, now = run.times, time.time()
        attributes = {**self._attributes(run), "tandem.status": status.name}
        error = error if error is not None or status != RequestStatus.FAILED else "failed"
        computed_here = times.adopted is None and times.received is not None
        first = times.first_token or run.first_output  # a moved attempt's first token: its first output
        if computed_here:
            end = first or now
            record(self._tracer, "tandem.prefill", run.request.request.trace, times.received, end,
                   {**attributes, "tandem.cached_tokens": cached_tokens}, [("scheduled", times.scheduled)],
                   error if first is None else None)
        began = times.adopted if not computed_here else first
        if began is not None:
            record(self._tracer, "tandem.decode", run.request.request.trace, began, times.finished or now,
                   {**attributes, "tandem.output_tokens": output_tokens}, error=error)
