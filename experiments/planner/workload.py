"""Synthetic workloads for `tandem plan`: lengths and inter-arrival gaps drawn once, for a mean rate of
1 request/s (the capacity model's `Workload` stretches them to any rate).

Length syntax is the load generator's: '128' (fixed), 'uniform:LOW:HIGH', 'lognormal:MEAN:STD'.
Arrivals: 'poisson', or gamma with `burstiness` = the gamma shape (1 is Poisson, < 1 burstier).
"""

from __future__ import annotations

import numpy as np

from experiments.capacity.workload import Workload
from experiments.loadgen.spec import LengthDist
from experiments.loadgen.workload import sample_length


def synthetic_workload(num_requests: int, prompt: LengthDist, output: LengthDist, arrival: str = "poisson",
                       burstiness: float = 1.0, seed: int = 0) -> Workload:
    if num_requests < 1:
        raise ValueError(f"num_requests must be >= 1, got {num_requests}")
    if arrival not in ("poisson", "gamma"):
        raise ValueError(f"arrival must be 'poisson' or 'gamma', got {arrival!r}")
    if burstiness <= 0:
        raise ValueError(f"burstiness (the gamma shape) must be > 0, got {burstiness}")
    rng = np.random.default_rng(seed)
    prompts = [sample_length(prompt, rng) for _ in range(num_requests)]
    outputs = [sample_length(output, rng) for _ in range(num_requests)]
    shape = 1.0 if arrival == "poisson" else burstiness
    gaps = rng.gamma(shape, 1.0 / shape, num_requests)
    gaps[0] = 0.0  # the first request opens the run
    return Workload(tuple(prompts), tuple(outputs), tuple(float(g) for g in gaps))
