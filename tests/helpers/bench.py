"""What every `tandem bench serve` run report must satisfy, whatever the server."""

from __future__ import annotations


def check_run(run: dict) -> None:
    counts, slo = run["counts"], run["slo"]
    assert counts["completed"] + counts["failed"] == counts["sent"]
    assert counts["failed"] == sum(run["failures"].values())
    measured = [r for r in run["requests"] if not r["warmup"]]
    assert len(measured) == counts["sent"]
    assert sum(r["error"] is None for r in measured) == counts["completed"]
    for name, stats in run["latency_ms"].items():
        if stats["n"]:
            assert 0 <= stats["p50"] <= stats["p90"] <= stats["p99"] <= stats["max"], (name, stats)
    assert run["latency_ms"]["ttft"]["n"] == counts["completed"]
    assert 0.0 <= slo["attainment"] <= 1.0
    assert slo["good"] <= counts["completed"]
    assert slo["goodput_rps"] <= run["throughput"]["requests_per_s"] + 1e-9
    assert run["client_lag_ms"]["max"] is not None
