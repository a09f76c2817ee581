"""Scheduled arrival times (seconds from the start of a run) of open-loop processes and traces.

Closed loop has no schedule: a request is due when one in flight finishes (see runner.py).
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from experiments.loadgen.spec import ArrivalSpec


def open_loop_offsets(spec: ArrivalSpec) -> Iterator[float]:
    """An endless, seeded schedule; the first request is due at 0."""
    rng = np.random.default_rng(spec.seed)
    t = 0.0
    while True:
        yield t
        if spec.kind == "constant":
            t += 1.0 / spec.rate
        elif spec.kind == "poisson":
            t += rng.exponential(1.0 / spec.rate)
        elif spec.kind == "gamma":
            # Shape k with scale 1/(rate k) keeps the mean gap at 1/rate; the gap's CV is 1/sqrt(k).
            t += rng.gamma(spec.burstiness, 1.0 / (spec.rate * spec.burstiness))
        else:
            raise AssertionError(f"{spec.kind} is not an open-loop process")


def trace_offsets(timestamps: list[float], rate: float | None) -> list[float]:
    """The trace's own timestamps from its first one, stretched or squeezed to `rate` requests/s if given."""
    start = timestamps[0]
    offsets = [t - start for t in timestamps]
    if rate is None or len(offsets) < 2 or offsets[-1] == 0:
        return offsets
    scale = (len(offsets) - 1) / offsets[-1] / rate
    return [t * scale for t in offsets]
