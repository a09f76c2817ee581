"""From request records to the numbers of a run (DESIGN.md "Measuring").

TTFT = first emit - scheduled arrival; ITL = gaps between emits (pooled over requests);
TPOT = (last emit - first emit) / (N - 1) per request with N >= 2; e2e = last emit - scheduled arrival.
A request is good when it completed and meets every SLO given (TPOT is vacuous when N < 2).
Attainment = good / sent and goodput = good / window, where the window runs from the first measured
scheduled arrival to the last measured completion. Warm-up requests are summarized apart.
"""

from __future__ import annotations

from collections import Counter

import numpy as np

from experiments.loadgen.http_client import RequestRecord
from experiments.loadgen.spec import BenchSpec

LATENCIES = ("ttft", "tpot", "itl", "e2e")


def stats_ms(seconds: list[float]) -> dict:
    """n, mean, p50, p90, p99 and max in milliseconds; None values when there are no samples."""
    if not seconds:
        return {"n": 0, "mean": None, "p50": None, "p90": None, "p99": None, "max": None}
    a = np.asarray(seconds, dtype=float) * 1e3
    p50, p90, p99 = np.percentile(a, [50, 90, 99])
    return {"n": int(a.size), "mean": float(a.mean()), "p50": float(p50), "p90": float(p90), "p99": float(p99),
            "max": float(a.max())}


def latency_stats(records: list[RequestRecord]) -> dict:
    ok = [r for r in records if r.ok]
    return {
        "ttft": stats_ms([r.ttft for r in ok if r.ttft is not None]),
        "tpot": stats_ms([r.tpot for r in ok if r.tpot is not None]),
        "itl": stats_ms([gap for r in ok for gap in r.itls]),
        "e2e": stats_ms([r.e2e for r in ok]),
    }


def is_good(r: RequestRecord, slo_ttft_ms: float | None, slo_tpot_ms: float | None) -> bool:
    if not r.ok:
        return False
    if slo_ttft_ms is not None and r.ttft * 1e3 > slo_ttft_ms:
        return False
    return slo_tpot_ms is None or r.tpot is None or r.tpot * 1e3 <= slo_tpot_ms


def counts(records: list[RequestRecord]) -> dict:
    completed = sum(r.ok for r in records)
    return {"sent": len(records), "completed": completed, "failed": len(records) - completed}


def failures(records: list[RequestRecord]) -> dict:
    return dict(sorted(Counter(r.error for r in records if r.error is not None).items()))


def refusals(records: list[RequestRecord]) -> dict:
    """Requests the server refused for load (429), and how long the refusal took from the send."""
    refused = [r for r in records if r.error == "http_429" and r.failed_at is not None and r.sent is not None]
    return {"n": len(refused), "answer_ms": stats_ms([r.failed_at - r.sent for r in refused])}


def summarize(records: list[RequestRecord], spec: BenchSpec) -> dict:
    measured = [r for r in records if not r.warmup]
    warm = [r for r in records if r.warmup]
    ok = [r for r in measured if r.ok]
    window = _window(measured)
    per_s = (lambda x: x / window) if window else (lambda x: 0.0)
    good = sum(is_good(r, spec.slo_ttft_ms, spec.slo_tpot_ms) for r in measured)
    output_tokens = sum(r.output_tokens if r.output_tokens is not None else len(r.emits) for r in ok)
    prompt_tokens = sum(r.prompt_tokens if r.prompt_tokens is not None else (r.prompt_len or 0) for r in ok)
    lags = [r.lag for r in measured if r.lag is not None]
    scheduled = sorted(r.scheduled for r in measured)
    return {
        "loop": "closed" if spec.arrival.kind == "closed" else "open",
        "arrival": spec.arrival.describe(),
        "workload": spec.workload.describe(),
        "counts": counts(measured),
        "failures": failures(measured),
        "duration_s": window,
        "offered_rate_rps": (len(scheduled) - 1) / (scheduled[-1] - scheduled[0])
        if len(scheduled) > 1 and scheduled[-1] > scheduled[0] else None,
        "throughput": {"requests_per_s": per_s(len(ok)), "output_tokens_per_s": per_s(output_tokens),
                       "prompt_tokens_per_s": per_s(prompt_tokens),
                       "total_tokens_per_s": per_s(output_tokens + prompt_tokens)},
        "latency_ms": latency_stats(measured),
        "slo": {"ttft_ms": spec.slo_ttft_ms, "tpot_ms": spec.slo_tpot_ms, "good": good,
                "attainment": good / len(measured) if measured else 0.0, "goodput_rps": per_s(good),
                "attainment_of_completed": good / len(ok) if ok else None},
        "refused": refusals(measured),
        "client_lag_ms": {"mean": float(np.mean(lags)) * 1e3 if lags else None,
                          "max": float(np.max(lags)) * 1e3 if lags else None},
        "cached_prompt_fraction": sum(r.cached_tokens or 0 for r in ok) / prompt_tokens if prompt_tokens else None,
        "output_len_mismatches": sum(r.output_tokens is not None and r.output_tokens != r.max_tokens for r in ok),
        "warmup": {"counts": counts(warm), "failures": failures(warm), "latency_ms": latency_stats(warm)},
    }


def _window(measured: list[RequestRecord]) -> float:
    ends = [r.end for r in measured if r.ok]
    if not measured or not ends:
        return 0.0
    return max(ends) - min(r.scheduled for r in measured)
