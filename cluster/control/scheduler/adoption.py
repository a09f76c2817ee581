"""Rebuilding the tracking of requests a worker still serves, when it registers with a scheduler that
does not know them (this scheduler restarted, or had given up on the worker during a stall): the table
decides (`RequestTable.adopt_live`), the outbox tells the workers."""

from __future__ import annotations

from actors.protocol.messages import LiveRequest
from cluster.control.scheduler.outbox import Outbox
from cluster.control.scheduler.placement import Placer
from cluster.control.scheduler.request_table import Adoption, RequestTable


def adopt_live(table: RequestTable, placer: Placer, outbox: Outbox, entry, item: LiveRequest) -> None:
    wid, attempt = entry.info.worker_id, item.request.attempt
    decided = table.adopt_live(wid, entry.view.role, item, placer.blocks_needed(item.request.request))
    if decided is Adoption.RELEASE:
        outbox.release_on(wid, attempt)
    elif decided is Adoption.ABORT:
        outbox.abort_on(wid, attempt)
    elif decided is Adoption.RELEASE_PREFILL:
        outbox.release_on(table.get(attempt.request_id).prefill.worker_id, attempt)
