"""The compare's terminal table and headline numbers: each layout's goodput, attainment and p99 ITL,
ratios against the first layout (the baseline), and the planner's predictions with their errors."""

from __future__ import annotations


def measured_runs(entry: dict) -> list[dict]:
    result = entry["result"]
    return result["runs"] if result.get("sweep") else [result]


def headline(data: dict) -> list[dict]:
    """One row per (layout, rate): the numbers the compare is about."""
    rows = []
    for entry in data["runs"]:
        for run in measured_runs(entry):
            lat, slo = run["latency_ms"], run["slo"]
            rows.append({"layout": entry["layout"], "rate_rps": run["spec"]["arrival"]["rate"],
                         "sent": run["counts"]["sent"], "failed": run["counts"]["failed"],
                         "goodput_rps": slo["goodput_rps"], "attainment": slo["attainment"],
                         "throughput_rps": run["throughput"]["requests_per_s"],
                         "ttft_p90_ms": lat["ttft"]["p90"], "tpot_p90_ms": lat["tpot"]["p90"],
                         "itl_p99_ms": lat["itl"]["p99"], "validation": run.get("validation"),
                         "validation_calibrated": run.get("validation_calibrated")})
    return rows


def ratios(rows: list[dict]) -> list[dict]:
    """Every layout against the first one at the same rate: goodput x, and baseline p99 ITL / its own."""
    base = {r["rate_rps"]: r for r in rows if r["layout"] == rows[0]["layout"]}
    out = []
    for r in rows:
        b = base.get(r["rate_rps"])
        if b is None or r is b:
            continue
        out.append({"layout": r["layout"], "baseline": b["layout"], "rate_rps": r["rate_rps"],
                    "goodput_ratio": _div(r["goodput_rps"], b["goodput_rps"]),
                    "itl_p99_improvement": _div(b["itl_p99_ms"], r["itl_p99_ms"]),
                    "attainment_delta": r["attainment"] - b["attainment"]})
    return out


def _div(a, b):
    return None if a is None or not b else a / b


def _f(x, fmt: str = ".3g") -> str:
    return "-" if x is None else format(x, fmt)


def _err(v: dict | None, key: str) -> str:
    if not v or v[key]["predicted"] is None:
        return "-"
    e = v[key]["relative_error"]
    return f"{v[key]['predicted']:.3g} ({'-' if e is None else f'{100 * e:+.0f}%'})"


def format_compare(data: dict) -> str:
    spec = data["spec"]
    rows = headline(data)
    lines = [f"workload: {data['runs'][0]['result'].get('workload') or measured_runs(data['runs'][0])[0]['workload']}",
             f"SLOs: TTFT {spec['slo_ttft_ms']} ms, TPOT {spec['slo_tpot_ms']} ms; each worker "
             f"{data['resources_per_worker']['num_cpus']:g} CPU, {data['resources_per_worker']['torch_threads']} thread(s); "
             f"load average {data['machine']['load_avg_start']} -> {data['machine']['load_avg_end']} "
             f"on {data['machine']['cpu_count']} CPUs", ""]
    header = (f"{'layout':<8}{'rate':>6}{'sent':>6}{'fail':>5}{'goodput':>9}{'attain':>8}{'p90 TTFT':>10}"
              f"{'p90 TPOT':>10}{'p99 ITL':>9}   {'sim goodput (err)':<19}{'sim p90 TTFT (err)':<19}")
    lines.append(header)
    for r in rows:
        lines.append(f"{r['layout']:<8}{_f(r['rate_rps']):>6}{r['sent']:>6}{r['failed']:>5}{_f(r['goodput_rps']):>9}"
                     f"{100 * r['attainment']:>7.1f}%{_f(r['ttft_p90_ms'], '.0f'):>10}{_f(r['tpot_p90_ms'], '.0f'):>10}"
                     f"{_f(r['itl_p99_ms'], '.0f'):>9}   {_err(r['validation'], 'goodput_rps'):<19}"
                     f"{_err(r['validation'], 'ttft_p90_ms'):<19}")
    lines.append("(goodput and rate in req/s, latencies in ms; sim = the planner's prediction on the same trace)")
    for r in rows:
        if r["validation_calibrated"]:
            v = r["validation_calibrated"]
            lines.append(f"{r['layout']}: with the profile refitted on its workers' calibration steps: sim goodput "
                         f"{_err(v, 'goodput_rps')}, sim p90 TTFT {_err(v, 'ttft_p90_ms')}, "
                         f"sim attainment {_err(v, 'attainment')}")
    for q in ratios(rows):
        lines.append(f"{q['layout']} vs {q['baseline']} at {_f(q['rate_rps'])} req/s: goodput x{_f(q['goodput_ratio'])}, "
                     f"p99 ITL {_f(q['itl_p99_improvement'])}x lower, attainment {100 * q['attainment_delta']:+.1f} points")
    return "\n".join(lines)
