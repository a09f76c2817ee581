"""Time-varying traces: phases of different traffic, one after the other.

The default trace has the four phases the autoscaler must follow: prompt-heavy (long prompts, short
answers: prefill work), decode-heavy (short prompts, long answers: decode work), a burst of mixed
traffic at 2.5x the rate, and a quiet phase at a fifth of it. Arrivals are Poisson within a phase,
lengths lognormal around the phase's means; one seed gives one trace.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from experiments.capacity.workload import SimRequest


@dataclass(frozen=True)
class Phase:
    name: str
    duration_s: float
    rate: float  # requests/s
    prompt_tokens: float  # mean
    output_tokens: float  # mean


def four_phases(rate: float, phase_s: float) -> list[Phase]:
    return [
        Phase("prompt-heavy", phase_s, rate, 3000, 100),
        Phase("decode-heavy", phase_s, rate, 500, 1500),
        Phase("burst", phase_s, 2.5 * rate, 1000, 250),
        Phase("quiet", phase_s, 0.2 * rate, 1000, 250),
    ]


def phase_bounds(phases: list[Phase]) -> list[tuple[str, float, float]]:
    """(name, start, end) of each phase."""
    out, t = [], 0.0
    for p in phases:
        out.append((p.name, t, t + p.duration_s))
        t += p.duration_s
    return out


def draw(phases: list[Phase], seed: int = 0, spread: float = 0.5) -> list[SimRequest]:
    """The trace's requests; lengths lognormal with sigma `spread` around each phase's means."""
    rng = np.random.default_rng(seed)
    out = []
    for phase, (_, start, end) in zip(phases, phase_bounds(phases)):
        t = start
        while True:
            t += rng.exponential(1.0 / phase.rate)
            if t >= end:
                break
            out.append(SimRequest(float(t), _length(rng, phase.prompt_tokens, spread),
                                  _length(rng, phase.output_tokens, spread)))
    return out


def _length(rng: np.random.Generator, mean: float, sigma: float) -> int:
    mu = np.log(mean) - sigma * sigma / 2  # so that the mean is `mean`
    return max(1, int(round(rng.lognormal(mu, sigma))))
