"""Which scheduler incarnation this is, and what it may say about requests an earlier one admitted.

Ray restarts a dead scheduler empty; it learns the requests in flight only from the workers that
register again. `epoch` keeps attempt ids unique across restarts and tells a client which incarnation
admitted its request. The incarnation has `settled` once every live worker has had time to register
again (twice the heartbeat timeout): only then may it say that a request it does not track is lost.
"""

from __future__ import annotations

import itertools
import time
import uuid

from actors.protocol.ids import AttemptId
from actors.protocol.messages import AdmittedBy, Forgotten


class Incarnation:
    def __init__(self, heartbeat_timeout_s: float):
        self.epoch = uuid.uuid4().hex[:6]
        self._born = time.monotonic()
        self._settle_s = 2 * heartbeat_timeout_s
        self._attempts = itertools.count()

    def next_attempt(self, request_id: str) -> AttemptId:
        return AttemptId(request_id, f"{self.epoch}{next(self._attempts)}")

    def settled(self) -> bool:
        return time.monotonic() - self._born >= self._settle_s

    def forgotten(self, admitted: tuple[AdmittedBy, ...], tracked) -> Forgotten:
        """Of the requests asked about that an earlier incarnation admitted, the ones tracked again (a
        worker announced them) and, once settled, the ones no live worker holds. `tracked`: a container
        of the request ids tracked now."""
        settled = self.settled()
        earlier = [a.request_id for a in admitted if a.epoch != self.epoch]
        known = tuple(rid for rid in earlier if rid in tracked)
        lost = tuple(rid for rid in earlier if settled and rid not in tracked)
        return Forgotten(self.epoch, settled, known, lost)
