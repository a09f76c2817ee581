"""The compare's PNGs, drawn from its JSON: bars per layout (goodput, attainment, p99 ITL, with the
planner's predictions when present), attainment vs rate per layout for sweeps, latency CDFs and a
timeline per layout (from the load generator's plots)."""

from __future__ import annotations

from pathlib import Path

from experiments.compare.report import headline, measured_runs
from experiments.loadgen.plots import plot_cdfs, plot_timeline, plt


def plot_bars(data: dict, path: Path) -> Path:
    rows = headline(data)
    labels = [f"{r['layout']}\n{r['rate_rps']:.3g}/s" if len(rows) > len(data["runs"]) else r["layout"] for r in rows]
    panels = [("goodput (req/s)", "goodput_rps", 1), ("SLO attainment (%)", "attainment", 100),
              ("p99 ITL (ms)", "itl_p99_ms", 1), ("p90 TTFT (ms)", "ttft_p90_ms", 1)]
    fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 3.8))
    x = range(len(rows))
    for ax, (title, key, scale) in zip(axes, panels):
        measured = [scale * (r[key] or 0) for r in rows]
        predicted = [scale * (r["validation"][key]["predicted"] or 0) if r["validation"] and key in r["validation"]
                     and r["validation"][key]["predicted"] is not None else None for r in rows]
        width = 0.4 if any(p is not None for p in predicted) else 0.6
        ax.bar([i - (width / 2 if width == 0.4 else 0) for i in x], measured, width, label="measured")
        if width == 0.4:
            ax.bar([i + width / 2 for i in x], [p or 0 for p in predicted], width, label="planner", hatch="//",
                   alpha=0.6)
        ax.set_xticks(list(x), labels)
        ax.set_title(title)
        ax.grid(axis="y", alpha=0.3)
    if any(r["validation"] for r in rows):
        axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def plot_attainment_vs_rate(data: dict, path: Path) -> Path:
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for entry in data["runs"]:
        runs = measured_runs(entry)
        rates = [r["spec"]["arrival"]["rate"] for r in runs]
        left.plot(rates, [100 * r["slo"]["attainment"] for r in runs], marker="o", label=entry["layout"])
        right.plot(rates, [r["slo"]["goodput_rps"] for r in runs], marker="s", label=entry["layout"])
    left.set(xlabel="arrival rate (req/s)", ylabel="SLO attainment (%)", ylim=(0, 105))
    right.set(xlabel="arrival rate (req/s)", ylabel="goodput (req/s)")
    for ax in (left, right):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def write_compare_plots(data: dict, json_path: Path) -> list[Path]:
    stem = Path(json_path).parent / Path(json_path).stem
    paths = [plot_bars(data, Path(f"{stem}_bars.png"))]
    if data["runs"][0]["result"].get("sweep"):
        paths.append(plot_attainment_vs_rate(data, Path(f"{stem}_attainment.png")))
    # CDFs at the highest rate every layout ran (the loaded end of a sweep).
    last = [(e["layout"], measured_runs(e)[-1]) for e in data["runs"]]
    paths.append(plot_cdfs(last, Path(f"{stem}_cdf.png"), last[0][1]["slo"]))
    for name, run in last:
        paths.append(plot_timeline(run, Path(f"{stem}_timeline_{name.replace(':', '')}.png")))
    return paths
