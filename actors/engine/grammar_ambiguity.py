"""A compile-time test for one kind of unbounded ambiguity in an EBNF grammar, which xgrammar accepts and
then pays for at every token: a rule that is both left- and right-recursive (`s ::= s s | "a"`, or
`e ::= e "+" e | "1"`, or `s ::= "a" s | s "b" | "c"`). Such a rule derives `A x A y A` two ways, so the
number of parses of an output grows without bound (Catalan-fast) and xgrammar's Earley states with it:
`s ::= s s | "a"` took 0.1 ms per token at token 10 and 11 ms at token 200 on the tiny model's 2,048-token
vocabulary, 100 ms on SmolLM2's 49,152 (one sequence; n = 12 slowed every stream ~11x).

The test is sound (every grammar it names is ambiguous, given its rules derive some string) but not
complete: ambiguity in general is undecidable, and a rule reached only through a nullable prefix is not
followed. What it misses, the engine's per-sequence grammar budget (structured.py) ends at run time.

It reads xgrammar's normalized grammar (`Grammar.serialize_json`, format v18 of xgrammar 0.2.x): every
expression is [type, length, data...]; a format it does not know is not judged (the budget still holds).
"""

from __future__ import annotations

import json

_FORMAT = "v18"
# xgrammar's GrammarExprType values in that format
_RULE_REF, _SEQUENCE, _CHOICES, _REPEAT = 4, 5, 6, 8


def ambiguity_problem(grammar) -> str | None:
    """Why an xgrammar `Grammar` is unboundedly ambiguous (naming the rule); None when this test finds
    no such rule."""
    data = json.loads(grammar.serialize_json())
    if data.get("__VERSION__") != _FORMAT:
        return None
    flat, starts = data["grammar_expr_data"], data["grammar_expr_indptr"]
    names = [rule[0] for rule in data["rules"]]
    bodies = [rule[1] for rule in data["rules"]]

    def expr(i: int) -> tuple[int, list[int]]:
        at = starts[i]
        return flat[at], flat[at + 2: at + 2 + flat[at + 1]]

    def edge_rules(i: int, last: bool) -> set[int]:
        """Rules an expression may begin (or end, `last`) with, directly."""
        kind, args = expr(i)
        if kind == _RULE_REF:
            return {args[0]}
        if kind == _REPEAT and args[1] >= 1:  # rule, min, max: at least one copy of the rule
            return {args[0]}
        if kind == _SEQUENCE and args:
            return edge_rules(args[-1 if last else 0], last)
        if kind == _CHOICES:
            return set().union(*(edge_rules(a, last) for a in args))
        return set()

    left = [edge_rules(b, False) for b in bodies]
    right = [edge_rules(b, True) for b in bodies]
    for rule in _reachable(data["root_rule_id"], bodies, expr):
        if _recurses(rule, left) and _recurses(rule, right):
            return (f"rule {names[rule]!r} is both left- and right-recursive, so an output can parse in "
                    "more ways the longer it grows (every token then costs more); write it so that each "
                    f"string parses one way (e.g. `{names[rule]} ::= item {names[rule]} | item`)")
    return None


def _recurses(rule: int, edges: list[set[int]]) -> bool:
    """`rule` reaches itself along `edges` (one or more steps)."""
    seen, todo = set(), list(edges[rule])
    while todo:
        r = todo.pop()
        if r == rule:
            return True
        if r not in seen:
            seen.add(r)
            todo += edges[r]
    return False


def _reachable(root: int, bodies: list[int], expr) -> list[int]:
    """Rules the root rule refers to, directly or not (itself included), in rule order."""
    seen, todo = {root}, [bodies[root]]
    while todo:
        kind, args = expr(todo.pop())
        if kind == _RULE_REF or kind == _REPEAT:
            if args[0] not in seen:
                seen.add(args[0])
                todo.append(bodies[args[0]])
        elif kind in (_SEQUENCE, _CHOICES):
            todo += args
    return sorted(seen)
