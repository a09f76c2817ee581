"""What a request's output must match (`SamplingParams.structured_output`): a JSON value, a JSON schema,
a regular expression, one of a list of strings, or a grammar. Plain data here; the engine compiles it
(actors/engine/structured.py) and the ingress compiles it first to answer a bad one with a 400."""

from __future__ import annotations

import json
import math
import re
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
# Counted repetition: xgrammar builds one state per repetition a bound allows, so its compile time grows
# faster than the bound (8 strings of maxLength 1,000: 1.6-2.8 s here; of 4,000: 72 s; of ~10^6: 12.4 s
# and a minute of the ingress's compile threads). Each bound (a JSON schema's maxLength, minLength,
# maxItems, minItems, maxProperties, minProperties, a regex's {m,n}) is capped, and so is their sum over
# one spec (8 bounds of 256 together compiled in 0.45 s).
MAX_REPEAT = 1024
MAX_REPEAT_TOTAL = 4096
COUNT_KEYWORDS = ("maxLength", "minLength", "maxItems", "minItems", "maxProperties", "minProperties")
# {m}, {m,} and {m,n} not preceded by a backslash (an escaped brace is a literal one)
_QUANTIFIER = re.compile(r"(?<!\\)\{\s*(\d+)\s*(?:,\s*(\d*)\s*)?\}")

# How a sequence whose grammar spent its engine-time budget ends (actors/engine/structured.py): the
# client's grammar, not the cluster, failed it, so the ingress answers 400 for it (lifecycle.py).
BUDGET_SPENT = "structured output over its budget: "


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
        if self.kind in ("regex", "grammar"):
            return _repeat_problem(self.kind, [("{m,n}", n) for n in _quantifier_bounds(self.spec)])
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
        if self.kind == "json_schema":
            return _repeat_problem(self.kind, _schema_bounds(value))
        return None


def _repeat_problem(kind: str, bounds: list[tuple[str, int]]) -> str | None:
    """Why a spec's counted repetitions are too many to compile (the keyword and the cap); None if not."""
    for keyword, bound in bounds:
        if bound > MAX_REPEAT:
            return f"the {kind}'s {keyword} is {bound}; at most {MAX_REPEAT} is compiled"
    total = sum(bound for _, bound in bounds)
    if total > MAX_REPEAT_TOTAL:
        named = ", ".join(sorted({keyword for keyword, _ in bounds}))
        return f"the {kind}'s repetition bounds ({named}) add up to {total}; at most {MAX_REPEAT_TOTAL} are compiled"
    return None


def _quantifier_bounds(regex: str) -> list[int]:
    """The largest count of each {m}, {m,} or {m,n} in a regex (or an EBNF grammar's repetitions)."""
    return [max(int(low), int(high or 0)) for low, high in _QUANTIFIER.findall(regex)]


def _schema_bounds(schema) -> list[tuple[str, int]]:
    """(keyword, bound) of every count keyword and every pattern's quantifier in a parsed JSON schema,
    without recursion (the depth check ran first, but a walk of its own costs nothing)."""
    bounds, todo = [], [schema]
    while todo:
        node = todo.pop()
        if isinstance(node, dict):
            for keyword in COUNT_KEYWORDS:
                value = node.get(keyword)
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    bounds.append((keyword, int(min(value, 1 << 62)) if math.isfinite(value) else 1 << 62))
            if isinstance(node.get("pattern"), str):
                bounds += [("pattern {m,n}", n) for n in _quantifier_bounds(node["pattern"])]
            todo += [v for v in node.values() if isinstance(v, (dict, list))]
        elif isinstance(node, list):
            todo += [v for v in node if isinstance(v, (dict, list))]
    return bounds


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
