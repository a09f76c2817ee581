"""The entry point every `tandem bench ...` command shares: run it, print, keep its JSON report."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Callable


def report_main(bench: Callable[[argparse.Namespace], dict]) -> Callable[[argparse.Namespace], int]:
    """Wrap `bench(args) -> report` as a subcommand: the report goes to `--out` when given."""
    def main(args: argparse.Namespace) -> int:
        report = bench(args)
        if args.out:
            Path(args.out).write_text(json.dumps(report, indent=2))
            print(f"report written to {args.out}")
        return 0

    return main
