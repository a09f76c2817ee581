"""What every configuration section shares: a typo or a bad value fails at load, naming the field."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def where(loc: tuple) -> str:
    """A field's path for an error message; an API key (a mapping key under api_keys) never appears."""
    parts = [str(p) for p in loc]
    for i, part in enumerate(parts[:-1]):
        if part == "api_keys":
            parts[i + 1] = "<key>"
    return ".".join(parts)
