"""The control-plane benchmark's PNGs."""

from __future__ import annotations

from pathlib import Path


def decision_plots(points: list[dict], out: Path) -> list[Path]:
    """Decision time p50/p99 vs workers (a line per rate) and vs rate (a line per worker count), as PNGs
    beside `out`; none when no series has two points."""
    if len(points) < 2:
        return []
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    axes = (("workers", "offered_rate", "simulated workers"), ("offered_rate", "workers", "offered rate (req/s)"))
    for x, group, label in axes:
        series: dict = {}
        for p in points:
            series.setdefault(p[group], []).append(p)
        if all(len(s) < 2 for s in series.values()):
            continue
        fig, ax = plt.subplots(figsize=(6, 4))
        for key, ps in sorted(series.items()):
            ps.sort(key=lambda p: p[x])
            for q, style in (("decision_p50_ms", "-o"), ("decision_p99_ms", "--s")):
                ax.plot([p[x] for p in ps], [p[q] for p in ps], style, label=f"{q[9:12]} ({group} {key:g})")
        ax.set_xlabel(label)
        ax.set_ylabel("scheduler decision time (ms)")
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
        path = out.with_name(f"{out.stem}-decision-vs-{x}.png")
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        plt.close(fig)
        paths.append(path)
    return paths
