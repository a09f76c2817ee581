"""Structured output with xgrammar: a request's `StructuredOutput` compiles (once per engine, cached) to
a grammar over the model's tokenizer; each sequence walks it with its own matcher. Before a token is
sampled, the matcher's bitmask removes every token the grammar forbids there (the sampler's first hard
constraint); after, the token advances the matcher. The grammar ends the sequence when it is complete
(its stop token accepted).

A sequence's matcher is rebuilt from its tokens wherever the sequence continues: a decode worker that
adopts a handed-off request feeds it the first token the prefill worker sampled, and a migrated request
feeds it the tokens the client already has, so the state is the one a single engine would hold.

What a grammar costs is paid where it is paid: each sequence's matcher time (filling its mask, accepting its
tokens) is measured in the engine thread's CPU time, so a busy box does not bill it, and a sequence whose
time passes its budget (`ms_per_token` per token it has walked, after a grace of `GRACE_TOKENS` tokens) is
ended with an error naming its grammar by the engine's stop conditions (postprocess.py) right after the token
that crossed it, so a grammar whose cost grows with the output cannot slow the batch for long. A grammar
that is ambiguous without bound is refused before it compiles (grammar_ambiguity.py). Compiled grammars are
cached by spec, least recently used first out, within `CACHE_BYTES` of xgrammar's own size estimate.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import OrderedDict

import torch

from actors.engine.grammar_ambiguity import ambiguity_problem
from actors.protocol.structured_output import BUDGET_SPENT, StructuredOutput

log = logging.getLogger("tandem.engine")
CACHE_ENTRIES = 256
CACHE_BYTES = 64 << 20  # a compiled grammar measured 0.1-2 MB here (8 bounded strings: 2 MB)
# Matcher time per token a sequence may spend on average (engine.grammar_ms_per_token's default). Ordinary
# grammars on this 2-core box: 0.01-0.03 ms per token with greedy picks on SmolLM2's 49,152-token vocabulary
# (0.8 ms at most for one token), 0.06-0.19 ms sampled at temperature 0.8 on the tiny model (json_object,
# a 2-field schema, an e-mail regex: test_grammar_budget.py prints them); the ambiguous grammars of issue 52
# pass 1 ms per token within ~150 tokens and 10 ms within ~200.
DEFAULT_MS_PER_TOKEN = 1.0
GRACE_TOKENS = 64  # the first tokens' budget up front: a matcher's first masks cost the most


class GrammarError(ValueError):
    """A structured-output spec that does not compile: the message names the problem."""


class Grammars:
    """One engine's (or one ingress's) grammar compiler over its tokenizer, and its compiled grammars."""

    def __init__(self, tokenizer, vocab_size: int, ms_per_token: float = DEFAULT_MS_PER_TOKEN):
        """`ms_per_token`: each sequence's matcher budget (engine.grammar_ms_per_token)."""
        import xgrammar as xgr

        self._xgr = xgr
        self.vocab_size = vocab_size
        self.ms_per_token = ms_per_token
        # xgrammar's own cache has no bound by default: this class's cache is the only one
        self._compiler = xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size),
                                             cache_enabled=False)
        self._compiled: OrderedDict[StructuredOutput, object] = OrderedDict()  # least recently used first
        self._cached_bytes = 0
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
            if spec not in self._compiled:
                self._compiled[spec] = grammar
                self._cached_bytes += grammar.memory_size_bytes
            while len(self._compiled) > 1 and (len(self._compiled) > CACHE_ENTRIES or self._cached_bytes > CACHE_BYTES):
                _, dropped = self._compiled.popitem(last=False)
                self._cached_bytes -= dropped.memory_size_bytes
        return grammar

    @property
    def cached(self) -> tuple[int, int]:
        """(compiled grammars cached, their bytes by xgrammar's estimate)."""
        with self._lock:
            return len(self._compiled), self._cached_bytes

    def check_integrity(self) -> None:
        with self._lock:
            counted = sum(g.memory_size_bytes for g in self._compiled.values())
            if counted != self._cached_bytes or len(self._compiled) > CACHE_ENTRIES or (
                    len(self._compiled) > 1 and counted > CACHE_BYTES):
                raise RuntimeError(f"grammar cache: {len(self._compiled)} entries of {counted} bytes, "
                                   f"counted {self._cached_bytes} (at most {CACHE_ENTRIES} and {CACHE_BYTES})")

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
            grammar = self._xgr.Grammar.from_ebnf(spec.spec)
            problem = ambiguity_problem(grammar)
            if problem is not None:
                raise GrammarError(f"the grammar is ambiguous: {problem}")
            return c.compile_grammar(grammar)
        except GrammarError:
            raise
        except Exception as exc:  # xgrammar reports bad schemas, regexes and grammars as RuntimeError
            raise GrammarError(f"{spec.kind} does not compile: {str(exc).strip().splitlines()[0][:300]}") from None

    def start(self, spec: StructuredOutput) -> GrammarState:
        return GrammarState(self._xgr.GrammarMatcher(self.compile(spec)), spec, self.ms_per_token)

    def mask(self, logits: torch.Tensor, rows: list[int], states: list[GrammarState]) -> None:
        """Forbid, in place, every token each row's grammar does not allow next; each state is billed
        its own fill."""
        started = time.perf_counter()
        xgr = self._xgr
        bitmask = xgr.allocate_token_bitmask(len(rows), self.vocab_size)
        for j, state in enumerate(states):
            state.fill(bitmask, j)
        view = logits[rows]
        xgr.apply_token_bitmask_inplace(view, bitmask.to(view.device), vocab_size=self.vocab_size)
        if view.shape[1] > self.vocab_size:  # padded logits past the vocabulary are never tokens
            view[:, self.vocab_size:] = float("-inf")
        logits[rows] = view
        self.mask_s += time.perf_counter() - started
        self.mask_steps += 1


class GrammarState:
    """One sequence's place in its grammar, and what walking it has cost (engine-thread CPU seconds)."""

    def __init__(self, matcher, spec: StructuredOutput, ms_per_token: float):
        self.matcher = matcher
        self.spec = spec
        self.budget_s_per_token = ms_per_token / 1000
        self.spent_s = 0.0
        self.tokens = 0  # tokens accepted (a continued sequence's replayed ones too: they cost the same)
        self.failure: str | None = None  # set once the budget is spent: the error the sequence ends with

    def fill(self, bitmask, row: int) -> None:
        started = time.thread_time()
        self.matcher.fill_next_token_bitmask(bitmask, row)
        self.spent_s += time.thread_time() - started

    def accept(self, token_id: int) -> bool:
        """Walk one token; False when the grammar does not take it. Past the budget, `failure` says so."""
        if self.matcher.is_terminated():
            return False
        started = time.thread_time()
        accepted = self.matcher.accept_token(token_id)
        self.spent_s += time.thread_time() - started
        self.tokens += 1
        allowed_s = (self.tokens + GRACE_TOKENS) * self.budget_s_per_token
        if self.failure is None and self.spent_s > allowed_s:
            self.failure = (f"{BUDGET_SPENT}the {self.spec.kind} {_excerpt(self.spec.spec)} took "
                            f"{self.spent_s * 1000:.0f} ms of engine time over {self.tokens} tokens, past its "
                            f"budget of {self.budget_s_per_token * 1000:g} ms per token "
                            f"(engine.grammar_ms_per_token); make it less ambiguous")
        return accepted

    @property
    def terminated(self) -> bool:
        return self.matcher.is_terminated()


def _excerpt(spec: str) -> str:
    return repr(spec if len(spec) <= 80 else spec[:77] + "...")


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
