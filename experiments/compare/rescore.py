"""How the verdict depends on the SLOs: the measured requests re-scored at other TTFT and TPOT limits.

A compare runs at one pair of SLOs, but which layout wins depends on them (disaggregation trades TTFT
for TPOT), so the JSON also holds each layout's goodput at 0.5x, 1x and 2x of each SLO given. The
re-scoring uses the load generator's own definitions (experiments/loadgen/metrics.py) on the saved records.
"""

from __future__ import annotations

from experiments.compare.report import measured_runs

SCALES = (0.5, 1.0, 2.0)


def good_count(run: dict, ttft_ms: float | None, tpot_ms: float | None) -> int:
    good = 0
    for r in run["requests"]:
        emits = r["emits_s"]
        if r["warmup"] or r["error"] is not None or not emits:
            continue
        ttft = 1e3 * (emits[0] - r["scheduled_s"])
        n = r["output_tokens"] or len(emits)
        tpot = 1e3 * (emits[-1] - emits[0]) / (n - 1) if n > 1 else None
        good += (ttft_ms is None or ttft <= ttft_ms) and (tpot_ms is None or tpot is None or tpot <= tpot_ms)
    return good


def slo_grid(data: dict) -> list[dict]:
    """Goodput of every layout (at its last rate) for each scaled pair of SLOs."""
    spec = data["spec"]
    ttfts = [None] if spec["slo_ttft_ms"] is None else [s * spec["slo_ttft_ms"] for s in SCALES]
    tpots = [None] if spec["slo_tpot_ms"] is None else [s * spec["slo_tpot_ms"] for s in SCALES]
    runs = [(e["layout"], measured_runs(e)[-1]) for e in data["runs"]]
    rows = []
    for ttft in ttfts:
        for tpot in tpots:
            goodput = {name: good_count(run, ttft, tpot) / run["duration_s"] if run["duration_s"] else 0.0
                       for name, run in runs}
            rows.append({"ttft_ms": ttft, "tpot_ms": tpot, "goodput_rps": goodput})
    return rows


def format_grid(rows: list[dict]) -> str:
    names = list(rows[0]["goodput_rps"])
    lines = ["goodput (req/s) at other SLOs: " + " | ".join(names) + (f"  (x vs {names[0]})" if len(names) > 1 else "")]
    for row in rows:
        g = [row["goodput_rps"][n] for n in names]
        ratio = "  " + " ".join(f"x{x / g[0]:.2f}" if g[0] else "x-" for x in g[1:]) if len(g) > 1 else ""
        lines.append(f"  TTFT <= {_ms(row['ttft_ms'])}, TPOT <= {_ms(row['tpot_ms'])}: "
                     + " | ".join(f"{x:.3f}" for x in g) + ratio)
    return "\n".join(lines)


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x:g} ms"
