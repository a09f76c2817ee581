"""Load shedding on the predicted time to first token, calibrated against what workers measure.

The cost model predicts how long a prompt waits on its prefill worker (queue + its own prefill +
transfer, plus the step in progress). A busy host or a stale cost makes that optimistic, so each
worker's predictions are scaled by a smoothed measured/predicted ratio learned from the
received -> first-token times the workers report.

The limit is `scheduler.max_predicted_ttft_s` when set. Unset, it is half the progress bound: a request
that waits that long without a token is moved for silence (cluster/frontend/request_stream.py) and
loses its place in the queue, so admitting one predicted to wait longer only wastes its prefill and
its decode reservation. That bounds every prefill queue by its measured service rate even when no
TTFT target is configured (measured on a 2-core box offered 10x its capacity: results/overload).
"""

from __future__ import annotations

from actors.protocol.ids import AttemptId
from actors.protocol.messages import FirstTokenWait
from cluster.control.scheduler.routing import PrefillPlan


class TtftGuard:
    def __init__(self, limit_s: float | None, setting: str = "scheduler.max_predicted_ttft_s"):
        self.limit_s = limit_s  # None: never shed
        self.setting = setting  # where the limit comes from, for the refusal's message
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

    def calibrated(self, worker_id: str, seconds: float) -> float:
        """`seconds` predicted on the worker, scaled as its measured first tokens say."""
        return seconds * self._calibration.get(worker_id, 1.0)

    def overshoot(self, plan: PrefillPlan, step_s: float | None, waited_s: float, queue_ahead: bool) -> float | None:
        """The predicted TTFT when it exceeds the limit (shed the request), else None (admit it).

        With nothing queued ahead shedding helps nobody, and admitting keeps the costs measured: a
        stale pessimistic estimate could otherwise reject everything forever."""
        if self.limit_s is None or not queue_ahead:
            return None
        ttft = waited_s + self.predict(plan, step_s) * self._calibration.get(plan.worker_id, 1.0)
        return ttft if ttft > self.limit_s else None


def shed_guard(settings) -> TtftGuard:
    """The guard of a scheduler with `settings` (SchedulerSettings): its configured TTFT target, else the
    point at which a silent request is moved anyway."""
    if settings.max_predicted_ttft_s is not None:
        return TtftGuard(settings.max_predicted_ttft_s)
    return TtftGuard(settings.progress_timeout_s / 2, "half of scheduler.progress_timeout_s, where a silent "
                                                      "request is moved; scheduler.max_predicted_ttft_s sets a target")
