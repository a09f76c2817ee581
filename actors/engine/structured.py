"""Structured output with xgrammar: a request's `StructuredOutput` compiles (once per engine, cached) to
a grammar over the model's tokenizer; each sequence walks it with its own matcher. Before a token is
sampled, the matcher's bitmask removes every token the grammar forbids there (the sampler's first hard
constraint); after, the token advances the matcher. The grammar ends the sequence when it is complete
(its stop token accepted).

A sequence's matcher is rebuilt from its tokens wherever the sequence continues: a decode worker that
adopts a handed-off request feeds it the first token the prefill worker sampled, and a migrated request
feeds it the tokens the client already has, so the state is the one a single engine would hold.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import OrderedDict

import torch

from actors.protocol.structured_output import StructuredOutput

log = logging.getLogger("tandem.engine")
_CACHE_SIZE = 256


class GrammarError(ValueError):
    """A structured-output spec that does not compile: the message names the problem."""


class Grammars:
    """One engine's (or one ingress's) grammar compiler over its tokenizer, and its compiled grammars."""

    def __init__(self, tokenizer, vocab_size: int):
        import xgrammar as xgr

        self._xgr = xgr
        self.vocab_size = vocab_size
        self._compiler = xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size))
        self._compiled: OrderedDict[StructuredOutput, object] = OrderedDict()
        self._lock = threading.Lock()
        self.mask_s = 0.0  # time spent filling and applying masks, and in how many steps
        self.mask_steps = 0
        self.compiles_begun = 0  # specs handed to xgrammar (a spec past the size limits never is)

    def compile(self, spec: StructuredOutput):
        """The compiled grammar (cached); GrammarError when it does not compile or is too large to try
        (`StructuredOutput.size_problem`). Any thread: a worker compiles off its engine thread."""
        with self._lock:
            grammar = self._compiled.get(spec)
            if grammar is not None:
                self._compiled.move_to_end(spec)
                return grammar
        problem = spec.size_problem()
        if problem is not None:
            raise GrammarError(problem)
        with self._lock:
            self.compiles_begun += 1
        grammar = self._compile(spec)  # outside the lock: xgrammar releases the GIL while it compiles
        with self._lock:
            self._compiled[spec] = grammar
            if len(self._compiled) > _CACHE_SIZE:
                self._compiled.popitem(last=False)
        return grammar

    def ready(self, spec: StructuredOutput) -> bool:
        """Compiled already: starting a sequence on it costs no compile."""
        with self._lock:
            return spec in self._compiled

    def _compile(self, spec: StructuredOutput):
        c = self._compiler
        try:
            if spec.kind == "json_object":  # any JSON object, with a schema's compact separators
                return c.compile_json_schema('{"type": "object"}', any_whitespace=False, strict_mode=False)
            if spec.kind == "json_schema":
                return c.compile_json_schema(_bounded_strings(spec.spec), any_whitespace=False, strict_mode=True)
            if spec.kind == "regex":
                return c.compile_regex(spec.spec)
            if spec.kind == "choice":
                return c.compile_grammar("root ::= " + " | ".join(json.dumps(s) for s in _choices(spec.spec)))
            return c.compile_grammar(spec.spec)
        except GrammarError:
            raise
        except Exception as exc:  # xgrammar reports bad schemas, regexes and grammars as RuntimeError
            raise GrammarError(f"{spec.kind} does not compile: {str(exc).strip().splitlines()[0][:300]}") from None

    def start(self, spec: StructuredOutput) -> GrammarState:
        return GrammarState(self._xgr.GrammarMatcher(self.compile(spec)))

    def mask(self, logits: torch.Tensor, rows: list[int], states: list[GrammarState]) -> None:
        """Forbid, in place, every token each row's grammar does not allow next."""
        started = time.perf_counter()
        xgr = self._xgr
        bitmask = xgr.allocate_token_bitmask(len(rows), self.vocab_size)
        for j, state in enumerate(states):
            state.matcher.fill_next_token_bitmask(bitmask, j)
        view = logits[rows]
        xgr.apply_token_bitmask_inplace(view, bitmask.to(view.device), vocab_size=self.vocab_size)
        if view.shape[1] > self.vocab_size:  # padded logits past the vocabulary are never tokens
            view[:, self.vocab_size:] = float("-inf")
        logits[rows] = view
        self.mask_s += time.perf_counter() - started
        self.mask_steps += 1


class GrammarState:
    """One sequence's place in its grammar."""

    def __init__(self, matcher):
        self.matcher = matcher

    def accept(self, token_id: int) -> bool:
        if self.matcher.is_terminated():
            return False
        return self.matcher.accept_token(token_id)

    @property
    def terminated(self) -> bool:
        return self.matcher.is_terminated()


def _bounded_strings(schema_text: str) -> str:
    r"""xgrammar 0.2.9 lets a string with minLength/maxLength (and no pattern) hold raw control characters,
    which strict JSON forbids (seen: a \x13 in a 40-character string); such strings get the same bounds as
    a pattern of the characters that need no escaping in the basic plane, which xgrammar matches as JSON
    strings (so a bounded string never holds an escape or a character beyond U+FFFF)."""
    try:
        schema = json.loads(schema_text)
    except json.JSONDecodeError:
        return schema_text  # xgrammar names the syntax error

    def walk(node):
        if isinstance(node, list):
            return [walk(x) for x in node]
        if not isinstance(node, dict):
            return node
        node = {k: walk(v) for k, v in node.items()}
        bounded = "minLength" in node or "maxLength" in node
        if node.get("type") == "string" and bounded and not {"pattern", "format", "enum", "const"} & node.keys():
            low, high = node.pop("minLength", 0), node.pop("maxLength", "")
            node["pattern"] = r"^[ !#-\[\]-\uffff]{%s,%s}$" % (low, high)
        return node

    return json.dumps(walk(schema))


def _choices(spec: str) -> list[str]:
    try:
        choices = json.loads(spec)
    except json.JSONDecodeError:
        choices = None
    if not isinstance(choices, list) or not choices or not all(isinstance(s, str) and s for s in choices):
        raise GrammarError("choice must be a non-empty list of non-empty strings")
    return choices
