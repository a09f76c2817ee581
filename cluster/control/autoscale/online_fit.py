"""Mode slo's model kept current: the profile's step cost refitted on the workers' own steps.

The profile file (`autoscaler.slo.profile`, from `tandem plan profile`) seeds the model. Every interval
the autoscaler takes the steps each worker logged since it last asked (actors/worker/step_log.py: each
step timed end to end, what the worker does between steps included) into a window of the most recent
ones, and refits the linear step cost on that window (capacity/fit.py) once it holds both prefill-only
and decode-only steps; the model's shape, engine limits and transfer stay the file's. A worker that does
not answer is skipped for the interval, and a window that cannot be fitted keeps the last fit.
"""

from __future__ import annotations

import logging
from collections import deque

import ray

from actors.worker.step_log import StepRecord
from cluster.control.autoscale.fit import refit
from cluster.control.autoscale.profile import EngineProfile

log = logging.getLogger("tandem.autoscaler")
WINDOW = 20_000  # steps, all workers together: a few minutes of a small cluster's steps
_READ_TIMEOUT_S = 10.0


class OnlineFit:
    def __init__(self, base: EngineProfile, window: int = WINDOW):
        self.base = base
        self._seen: dict[str, int] = {}  # worker id -> steps it had logged when last asked
        self._steps: deque[StepRecord] = deque(maxlen=window)
        self.fitted_on: dict | None = None  # what the last fit used (None: the file's cost still stands)

    def update(self, workers: dict) -> EngineProfile | None:
        """Take in the steps each of `workers` (id -> actor handle) logged since the last call; the profile
        refitted on the window, or None while it cannot be fitted."""
        asked = {wid: handle.step_log.remote(self._seen.get(wid, 0)) for wid, handle in workers.items()}
        answered, _ = ray.wait(list(asked.values()), num_returns=len(asked), timeout=_READ_TIMEOUT_S)  # one deadline
        answered = set(answered)
        for wid, ref in asked.items():
            if ref not in answered:
                log.debug("autoscaler: no step log from %s within %.0fs this interval", wid, _READ_TIMEOUT_S)
                continue
            try:
                total, steps = ray.get(ref, timeout=_READ_TIMEOUT_S)
            except ray.exceptions.RayError as exc:
                log.debug("autoscaler: no step log from %s this interval: %s", wid, exc)
                continue
            self._seen[wid] = total  # (a restarted worker counts from 0 again: asked from there next time)
            self._steps.extend(steps)
        self._seen = {wid: n for wid, n in self._seen.items() if wid in workers}
        try:
            profile = refit(self.base, list(self._steps), "the workers' step logs")
        except ValueError as exc:
            log.debug("autoscaler: the model keeps its cost: %s", exc)
            return None
        if self.fitted_on is None:
            log.info("autoscaler: the model's step cost is now fitted on the workers' own steps (%s)",
                     profile.samples[0]["fitted_on"])
        self.fitted_on = profile.samples[0]["fitted_on"]
        return profile
