"""What a request's output must match (`SamplingParams.structured_output`): a JSON value, a JSON schema,
a regular expression, one of a list of strings, or a grammar. Plain data here; the engine compiles it
(actors/engine/structured.py) and the ingress compiles it first to answer a bad one with a 400."""

from __future__ import annotations

from dataclasses import dataclass

KINDS = ("json_object", "json_schema", "regex", "choice", "grammar")


@dataclass(frozen=True)
class StructuredOutput:
    kind: str  # one of KINDS
    spec: str = ""  # the schema (JSON text), the regex, the choices (a JSON list of strings), the EBNF grammar

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"invalid sampling parameter structured_output.kind={self.kind!r}: expected one of {KINDS}")
        if not isinstance(self.spec, str) or (self.kind != "json_object" and not self.spec):
            raise ValueError(f"invalid sampling parameter structured_output.spec: {self.kind} needs a non-empty string")
