"""The metrics math on hand-made request records (DESIGN.md "Measuring")."""

from __future__ import annotations

import pytest

from experiments.loadgen.http_client import RequestRecord
from experiments.loadgen.metrics import is_good, stats_ms, summarize
from experiments.loadgen.spec import ArrivalSpec, BenchSpec


def record(index, scheduled, emits, output_tokens=None, warmup=False, error=None, sent=None):
    r = RequestRecord(index, warmup, prompt_len=10, max_tokens=len(emits), scheduled=scheduled,
                      sent=scheduled if sent is None else sent, emits=list(emits), prompt_tokens=10,
                      output_tokens=len(emits) if output_tokens is None else output_tokens)
    if error:
        r.error = error
    else:
        r.end = emits[-1]
    return r


def test_one_request_latencies():
    r = record(0, scheduled=0.5, emits=[1.0, 1.1, 1.3])
    assert r.ttft == pytest.approx(0.5)
    assert r.itls == pytest.approx([0.1, 0.2])
    assert r.tpot == pytest.approx(0.15)
    assert r.e2e == pytest.approx(0.8)
    # Several tokens in one chunk: TPOT divides by the server's token count, not the chunks.
    assert record(0, 0.0, [1.0, 2.0], output_tokens=5).tpot == pytest.approx(0.25)
    assert record(0, 0.0, [1.0]).tpot is None
    failed = record(0, 0.0, [1.0], error="timeout")
    assert (failed.ok, failed.ttft, failed.e2e, failed.itls) == (False, None, None, [])


def test_stats_percentiles():
    s = stats_ms([i / 1000 for i in range(1, 101)])  # 1..100 ms
    assert s["n"] == 100 and s["mean"] == pytest.approx(50.5) and s["max"] == pytest.approx(100)
    assert s["p50"] == pytest.approx(50.5) and s["p90"] == pytest.approx(90.1) and s["p99"] == pytest.approx(99.01)
    assert stats_ms([]) == {"n": 0, "mean": None, "p50": None, "p90": None, "p99": None, "max": None}


def test_good_needs_both_slos():
    r = record(0, 0.0, [0.2, 0.3, 0.4])  # TTFT 200 ms, TPOT 100 ms
    assert is_good(r, 200, 100) and is_good(r, None, None)
    assert not is_good(r, 199, 100) and not is_good(r, 200, 99)
    assert is_good(record(0, 0.0, [0.2]), 200, 1)  # one token: no TPOT to miss
    assert not is_good(record(0, 0.0, [0.2], error="http_503"), None, None)


def test_summary_counts_slo_and_warmup_apart():
    spec = BenchSpec(base_url="http://x", arrival=ArrivalSpec(kind="constant", rate=1.0), num_requests=4, warmup=1,
                     slo_ttft_ms=300, slo_tpot_ms=150, progress=False)
    records = [
        record(0, 0.0, [5.0, 6.0], warmup=True),               # warm-up: slow, not counted
        record(1, 1.0, [1.2, 1.3, 1.4], sent=1.002),            # good
        record(2, 2.0, [2.5, 2.6], sent=2.001),                 # TTFT 500 ms: bad
        record(3, 3.0, [3.1, 3.3, 3.5], sent=3.004),            # TPOT 200 ms: bad
        record(4, 4.0, [4.1], error="http_503", sent=4.0),
    ]
    records[4].end = None
    s = summarize(records, spec)
    assert s["counts"] == {"sent": 4, "completed": 3, "failed": 1}
    assert s["failures"] == {"http_503": 1}
    assert s["warmup"]["counts"] == {"sent": 1, "completed": 1, "failed": 0}
    assert s["warmup"]["latency_ms"]["ttft"]["p50"] == pytest.approx(5000)
    assert s["duration_s"] == pytest.approx(2.5)  # first measured arrival 1.0 to last completion 3.5
    assert s["offered_rate_rps"] == pytest.approx(1.0)
    assert s["slo"]["good"] == 1 and s["slo"]["attainment"] == pytest.approx(0.25)
    assert s["slo"]["goodput_rps"] == pytest.approx(1 / 2.5)
    assert s["throughput"]["requests_per_s"] == pytest.approx(3 / 2.5)
    assert s["throughput"]["output_tokens_per_s"] == pytest.approx(8 / 2.5)
    assert s["latency_ms"]["ttft"]["n"] == 3 and s["latency_ms"]["itl"]["n"] == 5 and s["latency_ms"]["tpot"]["n"] == 3
    assert s["client_lag_ms"]["max"] == pytest.approx(4.0) and s["client_lag_ms"]["mean"] == pytest.approx(1.75)
    assert s["loop"] == "open" and s["output_len_mismatches"] == 0
