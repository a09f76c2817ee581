"""The PNG timeline of `tandem bench autoscale`: pool sizes and SLO attainment per interval."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def timeline_png(report: dict, path: Path) -> None:
    fig, (sizes, attained) = plt.subplots(2, 1, figsize=(10, 6), sharex=True)
    end = report["duration_s"]
    for run in report["runs"]:
        for role, style in (("prefill", "-"), ("decode", "--")):
            times = [t for t, _ in run["timeline"]] + [end]
            counts = [s.get(role, 0) for _, s in run["timeline"]]
            sizes.step(times, counts + counts[-1:], style, where="post", label=f"{run['name']} {role}")
        interval = report["args"]["interval_s"]
        xs = [i * interval for i in range(len(run["attainment_per_interval"]))]
        attained.step(xs, [a if a is not None else float("nan") for a in run["attainment_per_interval"]],
                      where="post", label=run["name"])
    for axis in (sizes, attained):
        for phase in report["phases"][1:]:
            axis.axvline(phase["start_s"], color="grey", linewidth=0.8)
    for phase in report["phases"]:
        sizes.text(phase["start_s"] + 2, sizes.get_ylim()[1] * 0.95, phase["name"], fontsize=8, va="top")
    sizes.set_ylabel("workers (starting included)")
    attained.set_ylabel("SLO attainment")
    attained.axhline(0.9, color="red", linewidth=0.6, linestyle=":")
    attained.set_xlabel("trace time (s)")
    sizes.legend(fontsize=7, ncol=2)
    attained.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
