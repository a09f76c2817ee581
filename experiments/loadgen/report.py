"""Terminal tables for one run and for a sweep."""

from __future__ import annotations


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}"


def _slo_text(slo: dict) -> str:
    parts = [f"TTFT <= {slo['ttft_ms']:g} ms" if slo["ttft_ms"] else None,
             f"TPOT <= {slo['tpot_ms']:g} ms" if slo["tpot_ms"] else None]
    parts = [p for p in parts if p]
    return " and ".join(parts) if parts else "none given (good = completed)"


def _counts_text(c: dict, failures: dict) -> str:
    text = f"{c['sent']} sent, {c['completed']} completed, {c['failed']} failed"
    return text + (" (" + ", ".join(f"{k} x{v}" for k, v in failures.items()) + ")" if failures else "")


def latency_table(latency: dict) -> list[str]:
    lines = [f"{'latency (ms)':<14}{'n':>7}{'mean':>10}{'p50':>10}{'p90':>10}{'p99':>10}{'max':>10}"]
    for name in ("ttft", "tpot", "itl", "e2e"):
        s = latency[name]
        lines.append(f"{name.upper():<14}{s['n']:>7}" + "".join(f"{_ms(s[k]):>10}" for k in ("mean", "p50", "p90", "p99", "max")))
    return lines


def format_run(result: dict) -> str:
    """`result` is `BenchResult.to_dict()` (requests optional)."""
    t, slo, lag = result["throughput"], result["slo"], result["client_lag_ms"]
    offered = result["offered_rate_rps"]
    warm = result["warmup"]
    lines = [
        f"model {result['model']!r} at {result['spec']['base_url']}: {result['arrival']}",
        f"workload: {result['workload']}",
        f"requests: {_counts_text(result['counts'], result['failures'])}",
    ]
    if warm["counts"]["sent"]:
        lines.append(f"warm-up (not in the numbers below): {_counts_text(warm['counts'], warm['failures'])}, "
                     f"TTFT p50 {_ms(warm['latency_ms']['ttft']['p50'])} ms")
    lines += [
        f"window {result['duration_s']:.2f} s, offered {'-' if offered is None else f'{offered:.2f}'} req/s; "
        f"throughput {t['requests_per_s']:.2f} req/s, {t['output_tokens_per_s']:.1f} output tok/s, "
        f"{t['total_tokens_per_s']:.1f} total tok/s",
        f"SLO {_slo_text(slo)}: attainment {100 * slo['attainment']:.1f}% ({slo['good']} good), "
        f"goodput {slo['goodput_rps']:.2f} req/s",
        f"client lag (sent - scheduled): mean {_ms(lag['mean'])} ms, max {_ms(lag['max'])} ms",
    ]
    refused = result.get("refused")
    if refused and refused["n"]:
        share = slo["attainment_of_completed"]
        lines.append(f"refused for load (429): {refused['n']}, answered in p50 {_ms(refused['answer_ms']['p50'])} / "
                     f"p99 {_ms(refused['answer_ms']['p99'])} / max {_ms(refused['answer_ms']['max'])} ms from the send; "
                     f"completed requests meeting the SLO: {'-' if share is None else f'{100 * share:.1f}%'}")
    if result["cached_prompt_fraction"] is not None:
        lines.append(f"prompt tokens served from the server's prefix cache: {100 * result['cached_prompt_fraction']:.1f}%")
    if result["output_len_mismatches"]:
        lines.append(f"warning: {result['output_len_mismatches']} completed requests returned a different number "
                     "of tokens than max_tokens (does the server honour ignore_eos?)")
    if result["loop"] == "closed":
        lines.append("note: closed loop; latency excludes the queueing a real open arrival process would see")
    return "\n".join(lines + [""] + latency_table(result["latency_ms"]))


def format_sweep(sweep: dict) -> str:
    """`sweep` is `SweepResult.to_dict()`."""
    header = (f"{'rate':>8}{'offered':>9}{'req/s':>8}{'goodput':>9}{'attain':>8}{'p90 TTFT':>10}{'p99 TPOT':>10}"
              f"{'p99 ITL':>9}{'failed':>8}{'lag max':>9}")
    lines = [f"sweep: SLO {_slo_text(sweep['runs'][0]['slo'])}, target attainment {100 * sweep['target']:.0f}%",
             header]
    for run in sweep["runs"]:
        lat, offered = run["latency_ms"], run["offered_rate_rps"]
        lines.append(
            f"{run['spec']['arrival']['rate']:>8.3g}{'-' if offered is None else f'{offered:.3g}':>9}"
            f"{run['throughput']['requests_per_s']:>8.3g}{run['slo']['goodput_rps']:>9.3g}"
            f"{100 * run['slo']['attainment']:>7.1f}%{_ms(lat['ttft']['p90']):>10}{_ms(lat['tpot']['p99']):>10}"
            f"{_ms(lat['itl']['p99']):>9}{run['counts']['failed']:>8}{_ms(run['client_lag_ms']['max']):>9}")
    best = sweep["best_rate"]
    lines.append(f"highest rate with >= {100 * sweep['target']:.0f}% attainment: "
                 + ("none of the rates tried" if best is None else f"{best:.3g} req/s"))
    return "\n".join(lines)
