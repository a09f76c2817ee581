"""Which layouts a compare runs, and the `tandem serve` config each one starts.

A layout is written 'NC' (N colocated workers) or 'xP:yD' (x prefill + y decode workers). Every layout
of one compare has the same number of workers and every worker the same CPUs and torch threads, so the
comparison is at equal resources; only the split of work differs.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import yaml

from cluster.control.config import TandemConfig
from experiments.capacity.simulator import Layout

DEFAULT_LAYOUTS = "2C,1P:1D"


@dataclass(frozen=True)
class WorkerResources:
    num_cpus: float = 1.0
    torch_threads: int = 1


def parse_layout(text: str) -> Layout:
    text = text.strip()
    if m := re.fullmatch(r"(\d+)C", text, re.IGNORECASE):
        return Layout.colocated_workers(int(m[1]))
    if m := re.fullmatch(r"(\d+)P:(\d+)D", text, re.IGNORECASE):
        return Layout.disaggregated(int(m[1]), int(m[2]))
    raise ValueError(f"bad layout {text!r}: write 'NC' for N colocated workers or 'xP:yD', e.g. '2C' or '1P:3D'")


def parse_layouts(text: str) -> list[Layout]:
    layouts = [parse_layout(part) for part in text.split(",") if part.strip()]
    if not layouts:
        raise ValueError("--layouts names no layout")
    names = [layout.describe() for layout in layouts]
    if len(set(names)) != len(names):
        raise ValueError(f"--layouts repeats a layout: {', '.join(names)}")
    sizes = {layout.describe(): layout.num_workers for layout in layouts}
    if len(set(sizes.values())) > 1:
        raise ValueError(f"layouts must have the same number of workers to compare at equal resources, got {sizes}")
    return layouts


def layout_config(base: TandemConfig, layout: Layout, model_path: str, resources: WorkerResources,
                  local_prefill: bool) -> TandemConfig:
    """`base` with the layout's mode and pools, the model, and equal resources for every worker."""
    data = base.model_dump(mode="json")
    pool = {"num_cpus": resources.num_cpus, "torch_threads": resources.torch_threads}
    data["mode"] = layout.mode
    data["model"]["path"] = model_path
    data["prefill"] = {**data["prefill"], **pool, "replicas": max(layout.prefill, 1)}
    data["decode"] = {**data["decode"], **pool, "replicas": max(layout.decode, 1)}
    data["colocated"] = {**data["colocated"], **pool, "replicas": layout.colocated}
    data["scheduler"]["local_prefill"] = local_prefill
    return TandemConfig.model_validate(data)


def write_config(config: TandemConfig, path: Path) -> Path:
    path.write_text(yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False))
    return path
