"""`tandem bench tenants --runs N` reports each ratio's median and worst over the runs: a run where every
one of B's requests failed is the worst, never dropped."""

from __future__ import annotations

from experiments.bench_tenants import distribution, summarize


def run(ttft: float | None, whole: float = 1.2) -> dict:
    return {"b_ttft_p50_ratio": ttft, "b_ttft_p95_ratio": None if ttft is None else 2 * ttft, "b_p50_ratio": whole,
            "b_p95_ratio": whole, "b_failed": 0, "a_statuses": {"200": 3}, "a_peak_blocks": 10, "pool_blocks": 40}


def test_median_and_worst():
    d = distribution([run(1.3), run(4.1), run(1.5)])
    assert (d["b_ttft_p50_ratio"]["median"], d["b_ttft_p50_ratio"]["worst"]) == (1.5, 4.1)
    assert d["b_ttft_p95_ratio"]["worst"] == 8.2 and d["b_p50_ratio"]["runs"] == [1.2, 1.2, 1.2]


def test_a_run_with_no_answer_is_the_worst():
    d = distribution([run(1.3), run(None)])
    assert d["b_ttft_p50_ratio"]["median"] == 1.3 and d["b_ttft_p50_ratio"]["worst"] is None
    text = summarize({"policies": {"shares": run(None)}, "runs": {"shares": [run(1.3), run(None)]}})
    assert "over 2 runs" in text and "worst n/a (every request failed)" in text
