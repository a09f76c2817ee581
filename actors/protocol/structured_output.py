"""What a request's output must match (`SamplingParams.structured_output`): a JSON value, a JSON schema,
a regular expression, one of a list of strings, or a grammar. Plain data here; the engine compiles it
(actors/engine/structured.py) and the ingress compiles it first to answer a bad one with a 400."""

from __future__ import annotations

import json
from dataclasses import dataclass

KINDS = ("json_object", "json_schema", "regex", "choice", "grammar")
# What one request may ask to compile. Compile time grows faster than the spec: on this box xgrammar
# took 0.13 s for a 5,000-entry enum of short strings, 5.6 s for 5,000 entries of 40 characters and
# 12 s for 20,000 short ones (97 s seen for larger), while every spec within these bounds tried here
# compiled in under 0.3 s. The budget bounds the rest (a spec within them that still compiles slowly).
MAX_SPEC_BYTES = 64 * 1024
MAX_ALTERNATIVES = 5000  # enum values and choices, all told
MAX_DEPTH = 32  # nesting of a JSON schema's objects and lists
COMPILE_BUDGET_S = 10.0


@dataclass(frozen=True)
class StructuredOutput:
    kind: str  # one of KINDS
    spec: str = ""  # the schema (JSON text), the regex, the choices (a JSON list of strings), the EBNF grammar

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"invalid sampling parameter structured_output.kind={self.kind!r}: expected one of {KINDS}")
        if not isinstance(self.spec, str) or (self.kind != "json_object" and not self.spec):
            raise ValueError(f"invalid sampling parameter structured_output.spec: {self.kind} needs a non-empty string")

    def size_problem(self) -> str | None:
        """Why this spec is too large to compile (within the limits above); None when it is not."""
        size = len(self.spec.encode())
        if size > MAX_SPEC_BYTES:
            return f"the {self.kind} is {size} bytes; at most {MAX_SPEC_BYTES} are compiled"
        if self.kind not in ("json_schema", "choice"):
            return None
        try:
            value = json.loads(self.spec)
        except RecursionError:
            return f"the {self.kind} nests deeper than Python's parser goes; at most {MAX_DEPTH} levels are compiled"
        except ValueError:
            return None  # not JSON: the compiler names the syntax error
        alternatives, depth = _alternatives_and_depth(value) if self.kind == "json_schema" else (
            len(value) if isinstance(value, list) else 0, 1)
        if alternatives > MAX_ALTERNATIVES:
            return f"the {self.kind} has {alternatives} enum values or choices; at most {MAX_ALTERNATIVES} are compiled"
        if depth > MAX_DEPTH:
            return f"the {self.kind} nests {depth} levels deep; at most {MAX_DEPTH} are compiled"
        return None


def _alternatives_and_depth(schema) -> tuple[int, int]:
    """Enum values (all told) and the deepest nesting of a parsed JSON schema, without recursion (a
    hostile schema may nest deeper than Python's stack)."""
    alternatives, deepest, todo = 0, 0, [(schema, 1)]
    while todo:
        node, depth = todo.pop()
        deepest = max(deepest, depth)
        if isinstance(node, dict):
            if isinstance(node.get("enum"), list):
                alternatives += len(node["enum"])
            todo += [(v, depth + 1) for v in node.values() if isinstance(v, (dict, list))]
        elif isinstance(node, list):
            todo += [(v, depth + 1) for v in node if isinstance(v, (dict, list))]
    return alternatives, deepest
