"""What every `tandem bench ...` command shares at its end.

`--out` means the same everywhere: the path of the result JSON (default `bench-<name>-<time>.json` in
the working directory, or in `--out` when that is a directory); a command that draws PNGs puts them beside it. The last line printed sums the
run up in one line, `tandem bench <name>: ...; wrote <path>`, so a log or a CI job shows the result
without opening the file. A bench whose run proves a documented claim (`tandem bench chaos`: the README's
chaos numbers) passes a verdict: the command then exits 1 when the run broke the claim, after writing
the report and naming each broken part.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Callable, Sequence


def add_out_argument(p: argparse.ArgumentParser, name: str, beside: str = "") -> None:
    p.add_argument("--out", default=None,
                   help=f"result JSON (default: bench-{name}-<time>.json){'; ' + beside if beside else ''}")


def out_path(name: str, out: str | None) -> Path:
    default = f"bench-{name}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path = Path(out or default)
    if path.is_dir():  # a long run must not end without its report because --out named a folder
        path = path / default
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


def write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=1) + "\n")


def summary_line(name: str, text: str, out: Path, plots: Sequence[Path] = ()) -> str:
    beside = f" and {len(plots)} PNGs beside it ({', '.join(p.name for p in plots)})" if plots else ""
    return f"tandem bench {name}: {text}; wrote {out}{beside}"


def report_main(name: str, bench: Callable[[argparse.Namespace], dict], summarize: Callable[[dict], str],
                verdict: Callable[[dict], list[str]] | None = None) -> Callable[[argparse.Namespace], int]:
    """Wrap `bench(args) -> report` as a subcommand that writes the report to `--out` and sums it up.
    `verdict(report)`: what the run broke of the claim it checks ([]: it held), kept in the report as
    "broken"; anything broken makes the command exit 1. Without one the command exits 0."""
    def main(args: argparse.Namespace) -> int:
        out = out_path(name, args.out)  # before the run: a bad path fails at once, not after it
        report = bench(args)
        broken = verdict(report) if verdict is not None else []
        if verdict is not None:
            report["broken"] = broken
        write_json(out, report)
        print(summary_line(name, summarize(report), out), flush=True)
        for what in broken:
            print(f"tandem bench {name}: broken: {what}", file=sys.stderr, flush=True)
        return 1 if broken else 0

    return main
