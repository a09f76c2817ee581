"""Rebuilding the tracking of requests a worker still serves, when it registers with a scheduler that
does not know them (this scheduler restarted, or had given up on the worker during a stall)."""

from __future__ import annotations

from actors.protocol.messages import LivePhase, LiveRequest
from cluster.control.outbox import Outbox
from cluster.control.placement import Placer
from cluster.control.request_table import RequestTable
from cluster.control.routing import PrefillPlan
from cluster.control.scheduler_state import Tracked


def adopt_live(table: RequestTable, placer: Placer, outbox: Outbox, entry, item: LiveRequest) -> None:
    """Idempotent: a worker may announce the same request more than once."""
    wid, attempt, role = entry.info.worker_id, item.request.attempt, entry.view.role
    if item.phase is LivePhase.HELD:
        # Its pages were sent in full; the decode side announces the request itself. Tracking the
        # hold would outlive a request that finished while no scheduler could hear of it.
        outbox.release_on(wid, attempt)
        return
    tracked = table.get(attempt.request_id)
    if (tracked is not None and tracked.attempt != attempt) or table.was_aborted(attempt.request_id):
        outbox.abort_on(wid, attempt)  # an attempt that was superseded, or its client gave up
        return
    if tracked is None:
        decode_id = item.request.dest.decode_worker if role == "prefill" else wid
        tracked = Tracked(item.request.request, attempt, set(), decode_id, placer.blocks_needed(item.request.request))
        table.commit(tracked)
    tracked.workers.add(wid)
    tracked.awaiting_pages = role == "decode" and item.phase is LivePhase.RESERVED
    if role == "prefill":
        tracked.prefill = PrefillPlan(wid, False, 0, 0.0)
    elif item.phase is LivePhase.RUNNING and tracked.prefill is not None and tracked.prefill.worker_id != wid:
        tracked.handed_off = True
    if tracked.handed_off and tracked.prefill is not None and tracked.prefill.worker_id in tracked.workers:
        # The decode side adopted the pages while no scheduler could pass on its ack.
        outbox.release_prefill(tracked)
