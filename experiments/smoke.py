"""Smoke mode: with TANDEM_SMOKE=1 every bench and plan command runs at toy sizes.

It exists so that the README's commands can run, as written, in a test (tests/test_readme.py): the run
shows that a command works end to end, not how fast anything is, and the command says so when it
starts. Each command names its own small values next to its arguments (`smoke=` in its defaults).
"""

from __future__ import annotations

import argparse
import os

ENV = "TANDEM_SMOKE"


def active() -> bool:
    return os.environ.get(ENV, "") not in ("", "0")


def shrink(args: argparse.Namespace, small: dict) -> None:
    """Cap each named number at its smoke value (a smaller one given stays); replace anything else
    (models, length distributions, lists). Does nothing unless smoke mode is on."""
    if not active() or not small:
        return
    changed = []
    for name, value in small.items():
        old = getattr(args, name)
        new = min(old, value) if _number(old) and _number(value) else value
        if new != old:
            setattr(args, name, new)
            changed.append(f"{name}={new.describe() if hasattr(new, 'describe') else new}")
    print(f"smoke mode ({ENV}=1): {', '.join(changed) or 'sizes already small'}; "
          "the numbers below show that it runs, they are not measurements", flush=True)


def _number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)
