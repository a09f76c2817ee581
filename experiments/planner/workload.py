"""The simulator's input: requests as (arrival time, prompt length, output length).

`Workload` draws lengths and inter-arrival gaps once (for a mean rate of 1 request/s) and stretches the
gaps for any other rate, so the same requests arrive in the same order at every rate of a search: more
load means the same arrivals packed closer, which keeps attainment vs rate close to monotonic.

Length syntax is the load generator's: '128' (fixed), 'uniform:LOW:HIGH', 'lognormal:MEAN:STD'.
Arrivals: 'poisson', or gamma with `burstiness` = the gamma shape (1 is Poisson, < 1 burstier).
A trace (JSONL with timestamp, prompt_len, output_len) or any list of `SimRequest` works as well.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from experiments.loadgen.spec import LengthDist
from experiments.loadgen.workload import sample_length


@dataclass(frozen=True)
class SimRequest:
    arrival_s: float
    prompt_len: int
    output_len: int

    def __post_init__(self) -> None:
        if self.prompt_len < 1 or self.output_len < 1 or self.arrival_s < 0:
            raise ValueError(f"bad request {self}: prompt_len and output_len must be >= 1, arrival_s >= 0")


@dataclass(frozen=True)
class Workload:
    prompt_lens: tuple[int, ...]
    output_lens: tuple[int, ...]
    unit_gaps: tuple[float, ...]  # inter-arrival gaps at a mean rate of 1 request/s

    @classmethod
    def synthetic(cls, num_requests: int, prompt: LengthDist, output: LengthDist, arrival: str = "poisson",
                  burstiness: float = 1.0, seed: int = 0) -> "Workload":
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
        return cls(tuple(prompts), tuple(outputs), tuple(float(g) for g in gaps))

    def at_rate(self, rate: float) -> list[SimRequest]:
        if rate <= 0:
            raise ValueError(f"rate must be > 0 requests/s, got {rate}")
        arrivals = np.cumsum(self.unit_gaps) / rate
        return [SimRequest(float(t), p, o) for t, p, o in zip(arrivals, self.prompt_lens, self.output_lens)]


def load_trace(path: str | Path) -> list[SimRequest]:
    """JSONL, one request a line: {"timestamp": s, "prompt_len": n, "output_len": n}; times shift to start at 0."""
    rows = []
    for lineno, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            rows.append((float(row["timestamp"]), int(row["prompt_len"]), int(row["output_len"])))
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"{path}:{lineno}: need timestamp, prompt_len and output_len ({exc})") from None
    if not rows:
        raise ValueError(f"trace {path} has no requests")
    start = min(r[0] for r in rows)
    return sorted((SimRequest(t - start, p, o) for t, p, o in rows), key=lambda r: r.arrival_s)
