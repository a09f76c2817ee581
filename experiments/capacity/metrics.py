"""Per-request latencies and run aggregates of a simulation, with the definitions of DESIGN.md.

TTFT = first token - arrival; TPOT = (last token - first token) / (output tokens - 1); ITL = gap
between consecutive tokens; e2e = last token - arrival. A request is good when it meets both SLOs
(a one-token request has no TPOT and meets that SLO); a rejected request is never good. Attainment =
good / all requests; goodput and throughput divide good and completed requests by the run's span
(first arrival to last finish), so goodput <= throughput always.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from experiments.capacity.simulator import SimResult


@dataclass(frozen=True)
class SLO:
    ttft_s: float | None = None  # None: no TTFT condition
    tpot_s: float | None = None

    def met(self, ttft: float | None, tpot: float | None) -> bool:
        if ttft is None:
            return False
        return (self.ttft_s is None or ttft <= self.ttft_s) and (self.tpot_s is None or tpot is None or tpot <= self.tpot_s)


@dataclass(frozen=True)
class Stats:
    count: int
    mean: float | None
    p50: float | None
    p90: float | None
    p99: float | None

    @classmethod
    def of(cls, values: list[float]) -> "Stats":
        if not values:
            return cls(0, None, None, None, None)
        a = np.asarray(values, dtype=float)
        p50, p90, p99 = np.percentile(a, [50, 90, 99])
        return cls(len(a), float(a.mean()), float(p50), float(p90), float(p99))


@dataclass(frozen=True)
class RequestLatency:
    ttft_s: float | None
    tpot_s: float | None
    e2e_s: float | None
    good: bool


@dataclass(frozen=True)
class Summary:
    num_requests: int
    completed: int
    rejected: int
    duration_s: float
    throughput_rps: float
    goodput_rps: float
    attainment: float
    ttft: Stats
    tpot: Stats
    itl: Stats
    e2e: Stats

    def to_json(self) -> dict:
        return asdict(self)


def request_latencies(result: SimResult, slo: SLO) -> list[RequestLatency]:
    out = []
    for seq in result.seqs:
        arrival = seq.request.arrival_s
        ttft = None if seq.first_token_s is None else seq.first_token_s - arrival
        tpot = e2e = None
        if seq.finish_s is not None:
            e2e = seq.finish_s - arrival
            if seq.request.output_len > 1:
                tpot = (seq.finish_s - seq.first_token_s) / (seq.request.output_len - 1)
        out.append(RequestLatency(ttft, tpot, e2e, seq.finish_s is not None and slo.met(ttft, tpot)))
    return out


def summarize(result: SimResult, slo: SLO, with_itl: bool = True) -> Summary:
    lat = request_latencies(result, slo)
    finishes = [s.finish_s for s in result.seqs if s.finish_s is not None]
    start = min((s.request.arrival_s for s in result.seqs), default=0.0)
    span = max(finishes, default=start) - start
    completed, good = len(finishes), sum(r.good for r in lat)
    itls: list[float] = []
    if with_itl:
        for seq in result.seqs:
            if seq.finish_s is not None:
                itls.extend(np.diff(result.token_times(seq)).tolist())
    n = len(result.seqs)
    return Summary(
        num_requests=n, completed=completed, rejected=sum(s.rejected is not None for s in result.seqs),
        duration_s=span, throughput_rps=completed / span if span > 0 else 0.0,
        goodput_rps=good / span if span > 0 else 0.0, attainment=good / n if n else 0.0,
        ttft=Stats.of([r.ttft_s for r in lat if r.ttft_s is not None]),
        tpot=Stats.of([r.tpot_s for r in lat if r.tpot_s is not None]),
        itl=Stats.of(itls), e2e=Stats.of([r.e2e_s for r in lat if r.e2e_s is not None]),
    )


def attainment(result: SimResult, slo: SLO) -> float:
    """The fraction of requests meeting both SLOs (what the search bisects on; no percentiles computed)."""
    lat = request_latencies(result, slo)
    return sum(r.good for r in lat) / len(lat) if lat else 0.0
