"""Where the command line finds what it uses when a flag is not given."""

from pathlib import Path

DEFAULT_CONFIG = Path(__file__).resolve().parent.parent / "configs" / "default.yaml"
