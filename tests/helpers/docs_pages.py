"""The pages a user reads: README.md and the docs site's hand-written pages (docs/**/*.md), in that order.
The reference pages docs/gen_reference.py writes are the code's own words and are left out: tests that
compare the prose with the code read these."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
GENERATED = {REPO / "docs" / "reference" / name for name in ("configuration.md", "cli.md", "metrics.md", "fields.md")}


def written_pages() -> list[Path]:
    return [README, *(p for p in sorted((REPO / "docs").rglob("*.md")) if p not in GENERATED)]


def written_text() -> str:
    """Every written page, one after the other (a phrase a test looks for lives in one of them)."""
    return "\n\n".join(p.read_text() for p in written_pages())
