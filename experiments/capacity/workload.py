"""The simulator's input: requests as (arrival time, prompt length, output length).

`Workload` draws lengths and inter-arrival gaps once (for a mean rate of 1 request/s) and stretches the
gaps for any other rate, so the same requests arrive in the same order at every rate of a search: more
load means the same arrivals packed closer, which keeps attainment vs rate close to monotonic.

Synthetic workloads are drawn by `tandem plan` (experiments/planner/workload.py); a trace (JSONL with
timestamp, prompt_len, output_len) or any list of `SimRequest` works as well.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np


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
