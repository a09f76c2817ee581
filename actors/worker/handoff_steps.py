"""The engine thread's part of KV handoffs (actor.py calls these between steps, on that thread only): a
prefill worker sends a finished prompt's pages to the blocks a decode worker reserved, a decode worker
adopts pages that landed, and leases that outlive their deadline end. The handoff table (handoff_table.py)
keeps the leases; the data-plane ends (kv_handoff.py) move the bytes.
"""

from __future__ import annotations

import logging
import time
from typing import Callable

from actors.engine.engine import Engine
from actors.protocol.codec import ProtocolError, decode_note, encode
from actors.protocol.messages import HandedOff, HandoffNote, StageTimes
from actors.protocol.tp_messages import KvSendPlan, PieceEvent
from actors.worker.attempt_spans import AttemptSpans
from actors.worker.faults import Faults
from actors.protocol.handoff_phase import HandoffPhase
from actors.worker.handoff_table import HandoffTable
from actors.worker.kv_handoff import HandoffEnds
from actors.worker.meter import WorkerMeter
from actors.worker.running import Running
from actors.worker.spec import WorkerSpec

log = logging.getLogger("tandem.worker")
Fail = Callable[..., None]  # (request, message, retryable=False): the request ends with an error


class HandoffSteps:
    def __init__(self, spec: WorkerSpec, engine: Engine, table: HandoffTable, ends: HandoffEnds, meter: WorkerMeter,
                 faults: Faults, lead: Callable[[bytes], None] | None, fail: Fail,
                 adopted: Callable[[HandedOff], None], spans: AttemptSpans):
        """`lead`: a tensor-parallel rank 0's way to have its other ranks send their heads too; `adopted`: a
        handoff this decode worker now runs, for the next report; `spans`: the worker's trace spans."""
        self._spec, self._engine, self._table, self._ends, self._meter = spec, engine, table, ends, meter
        self._faults, self._lead, self._fail, self._adopted, self._spans = faults, lead, fail, adopted, spans

    def landed(self, event: PieceEvent, landed_at: float) -> None:
        """A piece of an attempt's pages was written, failed, or was refused (by any rank of this worker)."""
        piece = event.piece
        if event.stage == "refused":  # before a byte was written
            lease = self._table.refused(piece.lease_id)
            if lease is not None:
                self._fail(lease.context.request, f"KV transfer refused: {event.error}")
            return
        adopt = not self._faults.ignore_kv_arrivals  # ignored: the sender never gets an ack
        lease = self._table.landed(piece, ok=event.stage == "landed", note=event.note, adopt=adopt)
        if lease is None:
            return
        run: Running = lease.context
        request = run.request
        if event.stage != "landed":
            self._fail(request, f"KV transfer failed while writing: {event.error}", retryable=True)
            return
        blocks = len(self._engine.lease_blocks(request.attempt))
        try:
            note = decode_note(lease.note)
            self._engine.adopt(request.attempt, list(request.request.prompt_token_ids), note.first_token,
                               request.request.params, request.request.cache_salt, note.num_cached_tokens)
        except (ProtocolError, ValueError) as exc:
            self._table.release(request.attempt)
            self._fail(request, f"KV handoff refused: {exc}", retryable=True)
            return
        self._table.adopted(request.attempt)
        run.times = note.times.merged(StageTimes(landed=landed_at, adopted=time.time()))
        self._meter.adopted += 1
        self._meter.landed(note.prefill_worker, blocks * self._engine.model_bytes_per_block,
                           note.times.sent, landed_at)
        self._spans.adopted(run, note.trace, note.prefill_worker, blocks * self._engine.model_bytes_per_block)
        self._adopted(HandedOff(request.attempt, note.prefill_worker))  # reported at once

    def send(self, run: Running, out) -> None:
        """A prefill finished with its first token: its pages go to the decode worker's reserved blocks."""
        request, dest = run.request, run.request.dest
        self._table.hold(request.attempt)  # before the send: the lease owns the blocks being read
        nbytes = len(dest.reservation.block_ids) * self._engine.model_bytes_per_block
        prefill_span, send_span = self._spans.sending(run, out.num_cached_tokens, dest, nbytes)
        note = HandoffNote(out.new_token_ids[0], out.num_cached_tokens, self._spec.worker_id,
                           run.times.merged(StageTimes(sent=time.time())), self._spans.trace(send_span))
        plan = KvSendPlan(dest.reservation.lease_id, tuple(self._engine.lease_blocks(request.attempt)),
                          dest.reservation.block_ids, dest.endpoints, encode(note), min(self._spec.lease_s, 10.0))
        try:
            if not self._faults.drop_kv_sends:
                self._ends.hand_off(plan, self._lead)
        except Exception as exc:
            self._meter.transfers_failed += 1
            self._spans.sent(prefill_span, send_span, f"{type(exc).__name__}: {exc}")
            self._table.release(request.attempt)
            # The decode side is gone or unreachable: the client may continue the request elsewhere.
            self._fail(request, f"KV transfer to the decode worker failed: {exc}", retryable=True)
            return
        self._spans.sent(prefill_span, send_span)
        self._meter.transfers_sent += 1
        self._meter.kv_bytes_sent += nbytes

    def expire(self) -> None:
        """End the leases past their deadline: a hold's blocks are freed, a reservation's request fails."""
        for lease in self._table.expire(time.monotonic()):
            if lease.kind is HandoffPhase.HELD:
                log.warning("worker %s: no release for %s within the lease; freed its blocks",
                            self._spec.worker_id, lease.attempt)
            else:
                # The first token may have reached the client already: it can continue the request elsewhere.
                self._fail(lease.context.request, f"KV for {lease.attempt} did not arrive within the "
                                          f"{self._spec.lease_s}s lease", retryable=True)
