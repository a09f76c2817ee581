"""Refusal at the door: a request that would wait for admission longer than its budget is refused at
once (429 with Retry-After) instead of queueing.

Without it, a scheduler offered several times what it can admit let every request queue for its
whole `queue_timeout_s`: thousands of waiters tried to place themselves again and again, the work
crowded out the reports that free room, and the admitted rate fell to a small fraction of capacity
while nearly every request failed late (measured: 76 admitted/s at 3,000/s offered against ~590/s at
600/s, 64 simulated workers). Here the wait ahead of a new request is estimated from the requests
already waiting and the rate at which the scheduler has been admitting while it had any waiting:
admissions per busy second, decayed so that it follows the cluster as it changes. Below `_FLOOR`
waiting requests nothing is refused on this estimate (a burst on an idle cluster, whose rate is
not known yet, must not bounce). The floor is small because at slow rates a few requests are already a
long wait: a 2-core box serving a 135M model admits ~0.4 requests/s, where the former floor of 32 was
over a minute of work, so requests waited out the whole queue timeout and were refused late instead of
at once (measured, results/overload).

A stall is not overload either. When admissions stop (a worker killed and not yet declared lost, a pool whose
every worker is restarting), the busy seconds kept growing with nothing admitted, the measured rate fell
towards zero and the door refused everything: under crash-loop chaos, 429s predicting a wait of 10^10 s
while the workers came back within seconds. So busy time stops counting once no request has been admitted
for `_STALL_GAPS` of the intervals the last measured rate predicts (the measurement stands still: the rate
is the one from before the stall), and while `short_handed()` (the admitting pool has no worker at all) the door refuses nothing:
requests wait for the restart within their own queue timeout, as they would without a door.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from actors.protocol.messages import Rejected

_FLOOR = 8  # waiting requests below which the door never refuses
_HALF_LIFE_S = 2.0  # how fast the measured admission rate forgets
_MIN_BUSY_S = 0.2  # busy time measured before the rate means anything
_STALL_GAPS = 4.0  # this many mean admission intervals with no admission: a stall, not a rate


class AdmissionDoor:
    def __init__(self, clock=time.monotonic, short_handed: Callable[[], bool] = lambda: False):
        """`short_handed()`: the pool that admits has no worker now (an outage, not a rate)."""
        self._clock = clock
        self._short_handed = short_handed
        self.waiting = 0  # requests inside admission right now
        self._busy_s = 0.0  # decayed seconds with any request waiting
        self._admitted = 0.0  # decayed admissions in that time
        self._last = clock()
        self._last_admit: float | None = None  # when the last request was admitted
        self._rate_at_admit = 0.0  # the measured rate right after it
        self.refused = 0

    def rate(self) -> float | None:
        """Admissions per second while busy, as measured lately; None before enough was seen."""
        self._advance()
        return self._admitted / self._busy_s if self._busy_s >= _MIN_BUSY_S else None

    def refuse(self, budget_s: float, first_token_s: Callable[[], float] = lambda: 0.0) -> Rejected | None:
        """A refusal when the requests already waiting would take longer than `budget_s` to admit, counting
        what an admitted request then waits for its first token (`first_token_s()`, asked only past the
        floor: the best predicted TTFT)."""
        if self.waiting < _FLOOR or self._short_handed():
            return None
        rate = self.rate()
        if rate is None:
            return None
        wait_s, queue_s = self.waiting / max(rate, 1e-9), first_token_s()
        if wait_s + queue_s <= budget_s:
            return None
        self.refused += 1
        return Rejected(f"the scheduler is overloaded: {self.waiting} requests wait for admission, about "
                        f"{wait_s:.1f}s at the {rate:.1f}/s it admits, then ~{queue_s:.1f}s to a first token: past "
                        f"the {budget_s:.1f}s a request may wait (scheduler.queue_timeout_s, max_predicted_ttft_s, "
                        "half of progress_timeout_s); retry later", max(1.0, wait_s))

    def entered(self) -> None:
        self._advance()
        self.waiting += 1

    def left(self, admitted: bool) -> None:
        self._advance()
        self.waiting -= 1
        self._admitted += admitted
        if admitted:
            self._last_admit, self._rate_at_admit = self._last, self.rate() or 0.0

    def _stall_from(self) -> float:
        """When busy time stops counting: `_STALL_GAPS` mean intervals after the last admission."""
        if self._last_admit is None or self._rate_at_admit <= 0:
            return float("inf")
        return self._last_admit + _STALL_GAPS / self._rate_at_admit + _MIN_BUSY_S

    def _advance(self) -> None:
        now = self._clock()
        start, elapsed, self._last = self._last, now - self._last, now
        if elapsed <= 0:
            return
        if not self.waiting:
            counted = elapsed  # both decay alike: the rate keeps its value, and is forgotten in time
        elif self._short_handed():
            counted = 0.0  # no worker to admit onto: the measurement stands still
        else:
            counted = max(0.0, min(now, self._stall_from()) - start)  # a stall stands still too
        keep = 0.5 ** (counted / _HALF_LIFE_S)
        self._admitted *= keep
        self._busy_s = self._busy_s * keep + (counted if self.waiting else 0.0)

    def check_integrity(self) -> None:
        if self.waiting < 0:
            raise RuntimeError(f"admission door counts {self.waiting} waiting requests")
