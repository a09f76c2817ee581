"""PNG plots of result dicts (as saved in the JSON, per-request records included), written next to it.

Every function takes the JSON-shaped dicts, so plots can be redrawn from a saved file.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only; never a display
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402


def _ok(run: dict) -> list[dict]:
    return [r for r in run["requests"] if not r["warmup"] and r["error"] is None and r["end_s"] is not None]


def latency_samples_ms(run: dict) -> dict[str, list[float]]:
    ok = _ok(run)
    tpot = [(r["emits_s"][-1] - r["emits_s"][0]) / (n - 1) for r in ok
            if (n := r["output_tokens"] or len(r["emits_s"])) > 1]
    return {
        "TTFT": [1e3 * (r["emits_s"][0] - r["scheduled_s"]) for r in ok],
        "TPOT": [1e3 * t for t in tpot],
        "ITL": [1e3 * (b - a) for r in ok for a, b in zip(r["emits_s"], r["emits_s"][1:])],
        "E2E": [1e3 * (r["end_s"] - r["scheduled_s"]) for r in ok],
    }


def _cdf(ax, values: list[float], label: str | None) -> None:
    if values:
        x = np.sort(values)
        ax.plot(x, np.arange(1, len(x) + 1) / len(x), label=label)


def plot_cdfs(runs: list[tuple[str | None, dict]], path: Path, slo: dict | None = None) -> Path:
    """One panel per latency, one curve per (label, run)."""
    fig, axes = plt.subplots(1, 4, figsize=(16, 3.8))
    for label, run in runs:
        for ax, (name, values) in zip(axes, latency_samples_ms(run).items()):
            _cdf(ax, values, label)
    itl = [v for _, run in runs for v in latency_samples_ms(run)["ITL"]]
    if itl:  # a few long gaps would squash the body of the curve into the y axis
        axes[2].set_xlim(0, 1.1 * float(np.percentile(itl, 99.5)))
        axes[2].set_title("ITL CDF (to p99.5)")
    slo = slo or {}
    for ax, name in zip(axes, ("TTFT", "TPOT", "ITL", "E2E")):
        limit = {"TTFT": slo.get("ttft_ms"), "TPOT": slo.get("tpot_ms")}.get(name)
        if limit:
            ax.axvline(limit, color="red", linestyle="--", linewidth=1, label="SLO")
        if name != "ITL" or not itl:
            ax.set_title(f"{name} CDF")
        ax.set(xlabel="ms", ylim=(0, 1.02))
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("fraction of samples")
    if any(label for label, _ in runs) or slo.get("ttft_ms"):
        axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def plot_timeline(run: dict, path: Path) -> Path:
    """TTFT by scheduled arrival and ITL by emit time: stalls and queue build-up show as they happen."""
    ok = _ok(run)
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 6), sharex=True)
    top.scatter([r["scheduled_s"] for r in ok], [1e3 * (r["emits_s"][0] - r["scheduled_s"]) for r in ok], s=6)
    warm = [r for r in run["requests"] if r["warmup"] and r["error"] is None and r["emits_s"]]
    if warm:
        top.scatter([r["scheduled_s"] for r in warm], [1e3 * (r["emits_s"][0] - r["scheduled_s"]) for r in warm],
                    s=6, color="gray", label="warm-up")
    failed = [r for r in run["requests"] if not r["warmup"] and r["error"] is not None]
    if failed:
        top.scatter([r["scheduled_s"] for r in failed], [0] * len(failed), s=14, marker="x", color="red",
                    label="failed")
    if warm or failed:
        top.legend(fontsize=7)
    top.set(ylabel="TTFT (ms)", title=f"{run['model']}: {run['arrival']}")
    bottom.scatter([b for r in ok for b in r["emits_s"][1:]],
                   [1e3 * (b - a) for r in ok for a, b in zip(r["emits_s"], r["emits_s"][1:])], s=2, alpha=0.5)
    bottom.set(ylabel="ITL (ms)", xlabel="seconds from the start of the run")
    for ax in (top, bottom):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def plot_attainment(sweep: dict, path: Path) -> Path:
    runs = sweep["runs"]
    rates = [r["spec"]["arrival"]["rate"] for r in runs]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(rates, [100 * r["slo"]["attainment"] for r in runs], marker="o", label="SLO attainment")
    ax.axhline(100 * sweep["target"], color="red", linestyle="--", linewidth=1, label="target")
    ax.set(xlabel="arrival rate (req/s)", ylabel="attainment (%)", ylim=(0, 105))
    ax.grid(alpha=0.3)
    right = ax.twinx()
    right.plot(rates, [r["slo"]["goodput_rps"] for r in runs], marker="s", color="tab:green", label="goodput")
    right.plot(rates, [r["throughput"]["requests_per_s"] for r in runs], marker=".", color="tab:gray",
               label="throughput")
    right.set(ylabel="req/s")
    handles = ax.get_legend_handles_labels()[0] + right.get_legend_handles_labels()[0]
    ax.legend(handles, [h.get_label() for h in handles], fontsize=7, loc="lower left")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def write_plots(result: dict, json_path: Path) -> list[Path]:
    """Plots for a run or a sweep dict, named after the JSON file: <stem>_cdf.png, <stem>_timeline.png, ..."""
    json_path = Path(json_path)
    stem = json_path.parent / json_path.stem
    if result.get("sweep"):
        runs = result["runs"]
        slo = runs[0]["slo"]
        return [plot_attainment(result, Path(f"{stem}_attainment.png")),
                plot_cdfs([(f"{r['spec']['arrival']['rate']:.3g} req/s", r) for r in runs], Path(f"{stem}_cdf.png"), slo),
                plot_timeline(runs[-1], Path(f"{stem}_timeline.png"))]
    return [plot_cdfs([(None, result)], Path(f"{stem}_cdf.png"), result["slo"]),
            plot_timeline(result, Path(f"{stem}_timeline.png"))]
