"""Load shedding on the predicted time to first token, calibrated against what workers measure.

The cost model predicts how long a prompt waits on its prefill worker (queue + its own prefill +
transfer, plus the step in progress). A busy host or a stale cost makes that optimistic, so each
worker's predictions are scaled by a smoothed measured/predicted ratio learned from the
received -> first-token times the workers report.
"""

from __future__ import annotations

from actors.protocol.ids import AttemptId
from actors.protocol.messages import FirstTokenWait
from cluster.control.routing import PrefillPlan


class TtftGuard:
    def __init__(self, limit_s: float | None):
        self.limit_s = limit_s  # None: never shed
        self._predicted: dict[AttemptId, float] = {}  # predicted seconds on its worker, until measured
        self._calibration: dict[str, float] = {}  # worker id -> measured / predicted, smoothed

    @staticmethod
    def predict(plan: PrefillPlan, step_s: float | None) -> float:
        """Seconds from reaching the worker to its first token; a new prompt first waits out the step in progress."""
        return plan.predicted_ttft_s + (step_s or 0.0)

    def expect(self, attempt: AttemptId, plan: PrefillPlan, step_s: float | None) -> None:
        self._predicted[attempt] = self.predict(plan, step_s)

    def forget(self, attempt: AttemptId) -> None:
        self._predicted.pop(attempt, None)

    def observe(self, worker_id: str, waits: tuple[FirstTokenWait, ...]) -> None:
        """The worker's measured received -> first token times."""
        for wait in waits:
            predicted = self._predicted.pop(wait.attempt, None)
            if predicted:
                ratio = min(max(wait.seconds / max(predicted, 1e-3), 0.5), 10.0)
                self._calibration[worker_id] = 0.7 * self._calibration.get(worker_id, 1.0) + 0.3 * ratio

    def overshoot(self, plan: PrefillPlan, step_s: float | None, waited_s: float, queue_ahead: bool) -> float | None:
        """The predicted TTFT when it exceeds the limit (shed the request), else None (admit it).

        With nothing queued ahead shedding helps nobody, and admitting keeps the costs measured: a
        stale pessimistic estimate could otherwise reject everything forever."""
        if self.limit_s is None or not queue_ahead:
            return None
        ttft = waited_s + self.predict(plan, step_s) * self._calibration.get(plan.worker_id, 1.0)
        return ttft if ttft > self.limit_s else None
