"""What a restarted scheduler learns back, and what it may answer meanwhile.

Ray restarts a dead scheduler empty. Its workers register again with the requests they hold
(`adopt_live`, adoption.py); its clients resend submits whose answers were lost and audit the requests
an earlier incarnation admitted. Until the incarnation has settled (every live worker has had time to
register again) a request it does not track is neither known nor lost. One case needs care: a
reservation a decode worker announces that no prefill worker claims is an orphan (the old scheduler
died between reserving and sending the prompt); it is dropped once settled, never called known.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from actors.protocol.ids import AttemptId
from actors.protocol.messages import Admitted, AdmittedBy, Forgotten, GenerateRequest, LiveRequest
from cluster.control.scheduler.adoption import adopt_live
from cluster.control.scheduler.incarnation import Incarnation
from cluster.control.scheduler.outbox import Outbox
from cluster.control.scheduler.placement import Placer
from cluster.control.scheduler.request_table import RequestTable

log = logging.getLogger("tandem.scheduler")


class Rebuild:
    def __init__(self, table: RequestTable, placer: Placer, outbox: Outbox, incarnation: Incarnation,
                 reclaim: Callable[[AttemptId], object]):
        """`reclaim(attempt)`: the scheduler's one terminal path, as a failure."""
        self._table, self._placer, self._out, self._incarnation = table, placer, outbox, incarnation
        self._reclaim = reclaim
        self._orphans_dropped = False

    def adopt(self, entry, live: list[LiveRequest]) -> None:
        """The requests a (re-)registering worker still holds."""
        for item in live:
            adopt_live(self._table, self._placer, self._out, entry, item)

    async def admitted_before(self, request: GenerateRequest) -> Admitted | None:
        """A submit sent again because the scheduler that had it died: an earlier incarnation may have
        admitted it already, and then its worker announces it once this one has settled. Until then the
        request waits; if it is known by then, its admission is answered again instead of run twice."""
        rid = request.request_id
        while (not self._incarnation.settled() and not self._table.claimed(rid)) or self._table.admitting(rid):
            await asyncio.sleep(0.05)  # (the first send may still be admitting, if only its answer was lost)
        self.drop_orphans()
        tracked = self._table.get(rid)  # re-read after the awaits
        if tracked is None or tracked.request.sink != request.sink:
            return None
        prefill = tracked.prefill.worker_id if tracked.prefill is not None else tracked.decode_id
        return Admitted(prefill, tracked.decode_id, 0, tracked.prefill is None, self._incarnation.epoch)

    def forgotten(self, admitted: tuple[AdmittedBy, ...]) -> Forgotten:
        """A client's audit of its requests in flight. Ones an earlier incarnation admitted that no live
        worker announced since this one started were lost with the old scheduler (queued in it, or on a
        worker that died while no scheduler could notice): the client migrates them. Answered only once
        every live worker has had time to register again (twice the heartbeat timeout)."""
        self.drop_orphans()
        claimed = {a.request_id for a in admitted if self._table.claimed(a.request_id)}
        return self._incarnation.forgotten(admitted, claimed)

    def drop_orphans(self) -> None:
        """Once settled, a reservation a decode worker announced whose prompt no prefill worker announced
        will never get its pages: the scheduler that placed it died before sending the prompt, or the
        prefill worker died in the same window. It is reclaimed (the reservation aborted); its client's
        audit then finds the request lost and migrates it, or its resent submit is admitted afresh.
        Read before either answers: an orphan answered as "known" would wait for its lease instead."""
        if self._orphans_dropped or not self._incarnation.settled():
            return
        self._orphans_dropped = True
        for tracked in self._table.orphaned():
            log.warning("request %s: reserved on %s but no prefill worker holds its prompt; dropped",
                        tracked.attempt, tracked.decode_id)
            self._reclaim(tracked.attempt)
