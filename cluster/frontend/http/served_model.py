"""What one ingress serves, and how a request's prompt and fields are checked against it before anything is
admitted: the model's name, context and vocabulary, its tokenizer and chat template, the request caps,
prompts tokenized and templated off the event loop, and structured outputs compiled once here so that a
spec that does not compile is a 400 naming its field.
"""

from __future__ import annotations

import asyncio
import threading

from actors.engine.structured import GrammarError, Grammars
from actors.protocol.structured_output import COMPILE_BUDGET_S, StructuredOutput
from cluster.frontend.http.body_guard import current_tenant
from cluster.frontend.http.chat_template import TemplateOptions, render, template_variables
from cluster.frontend.http.compile_slots import CompileSlots, CompileSlotsBusy
from cluster.frontend.http.fields import check_fields
from cluster.frontend.http.protocol import ApiError, RequestCaps


class ServedModel:
    def __init__(self, name: str, tokenizer, max_model_len: int, vocab_size: int, caps: RequestCaps = RequestCaps(),
                 chat_template: str | None = None, tool_call_parser: str | None = None):
        self.name = name
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.caps = caps
        self.chat_template = chat_template  # None: the model's own
        self.tool_call_parser = tool_call_parser
        self._grammars: Grammars | None = None  # compiles structured outputs to check them (made on first use)
        self._grammars_made = threading.Lock()
        # Grammars compile on threads of their own (xgrammar releases the GIL), a few per tenant at a time:
        # a flood of slow specs waits there, never in the event loop's default pool that tokenizing uses.
        self.compiles = CompileSlots()
        self.template_variables = template_variables(chat_template or getattr(tokenizer, "chat_template", None))
        self.max_prompt_chars = _max_chars(tokenizer, max_model_len)

    async def encode_prompts(self, prompt, truncate: int | None = None, add_special_tokens: bool = True) -> list[list[int]]:
        """Token ids of each prompt, each cut to its last `truncate` tokens (vLLM's truncate_prompt_tokens);
        the tokenizer runs off the event loop (a long prompt takes a while)."""
        if isinstance(prompt, str):
            raw = [prompt]
        elif prompt and all(isinstance(p, int) for p in prompt):
            raw = [list(prompt)]
        elif isinstance(prompt, list) and prompt:
            raw = list(prompt)
        else:
            raise ApiError(400, "prompt must not be empty", "prompt")
        if len(raw) > self.caps.max_prompts:
            raise ApiError(400, f"prompt holds {len(raw)} prompts; at most {self.caps.max_prompts} per request",
                           "prompt")
        for p in raw:
            if isinstance(p, str):
                check_text(p, "prompt")
                self.check_chars(len(p), "prompt")
        prompts = await asyncio.to_thread(lambda: [self.tokenizer.encode(p, add_special_tokens=add_special_tokens)
                                                   if isinstance(p, str) else list(p) for p in raw])
        prompts = [self.truncated(p, truncate) for p in prompts]
        for p in prompts:
            self.check_prompt(p, "prompt")
        return prompts

    def chat_prompt(self, messages: list[dict], tools: list[dict] | None = None,
                    options: TemplateOptions = TemplateOptions()) -> list[int]:
        """The conversation through the chat template, as token ids (call it off the event loop)."""
        options.check(self.template_variables, messages)
        return render(self.tokenizer, self.chat_template, messages, tools, options,
                      lambda n: self.check_chars(n, "messages"))

    def check_chars(self, chars: int, param: str) -> None:
        """Before tokenizing: text longer than any prompt the context holds is a 400 without the tokenizer's
        time (a 1 MB prompt took ~1.8 s of it, 666k tokens, only to be refused by `check_prompt`)."""
        if self.max_prompt_chars is not None and chars > self.max_prompt_chars:
            raise ApiError(400, f"{param} has {chars} characters; this model's context ({self.max_model_len} tokens) "
                                f"holds at most {self.max_prompt_chars}", param)

    def truncated(self, ids: list[int], keep: int | None) -> list[int]:
        """The last `keep` tokens of a prompt (-1: as many as the context holds; None: all)."""
        if keep is None:
            return ids
        if keep == 0:
            raise ApiError(400, "truncate_prompt_tokens must be at least 1 (or -1: the model's context)",
                           "truncate_prompt_tokens")
        keep = self.max_model_len if keep == -1 else keep
        return ids[-keep:]

    def check_prompt(self, ids: list[int], param: str) -> None:
        if not ids:
            raise ApiError(400, f"{param} must not be empty", param)
        if len(ids) >= self.max_model_len:
            raise ApiError(400, f"{param} has {len(ids)} tokens; this model's context is {self.max_model_len}", param)
        if any(not 0 <= t < self.vocab_size for t in ids):
            raise ApiError(400, f"{param} holds a token id outside the vocabulary [0, {self.vocab_size})", param)

    async def structured_output(self, req) -> StructuredOutput | None:
        """The request's structured output, compiled here first (off the event loop) so that a schema,
        regex or grammar that does not compile is a 400 naming it, before anything is admitted."""
        asked = req.structured_output()
        if asked is None:
            return None
        return await self.check_structured(*asked)

    async def check_structured(self, spec: StructuredOutput, param: str, tenant: str | None = None) -> StructuredOutput:
        """Compile `spec` on a compile thread of the tenant's (default: the one the request authenticated as),
        within the budget; a 400 naming `param` when it is too large, does not compile, or takes longer (that
        compile goes on, unseen, holding its tenant's slot, and is cached when it ends); a 429 when the
        tenant's earlier compiles still hold every slot."""
        problem = spec.size_problem()
        if problem is not None:  # before any thread is taken
            raise ApiError(400, f"{param}: {problem}", param)
        if self._grammars is not None and self._grammars.ready(spec):
            return spec  # compiled before: no thread, no slot
        tenant = tenant if tenant is not None else current_tenant.get()
        try:
            await self.compiles.run(tenant, lambda: self._grammar_compiler().compile(spec), COMPILE_BUDGET_S)
        except GrammarError as exc:
            raise ApiError(400, f"{param}: {exc}", param) from None
        except asyncio.TimeoutError:
            raise ApiError(400, f"{param}: the {spec.kind} did not compile within {COMPILE_BUDGET_S:g} s; "
                           "make it smaller", param) from None
        except CompileSlotsBusy as busy:
            raise ApiError(429, f"{param}: {busy}; retry when they end", param, "rate_limit_error",
                           headers={"Retry-After": str(int(COMPILE_BUDGET_S))}) from None
        return spec

    def _grammar_compiler(self) -> Grammars:
        """The ingress's compiler, made on first use (a compile thread: it reads the whole vocabulary)."""
        with self._grammars_made:
            if self._grammars is None:
                self._grammars = Grammars(self.tokenizer, self.vocab_size)
            return self._grammars

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.name:
            raise ApiError(404, f"model {model!r} does not exist; this server serves {self.name!r}", "model",
                           "not_found_error")

    def check_common(self, req, max_tokens: int | None) -> int | None:
        """The checks every generating request passes before its prompt is made; its max_tokens as asked
        (None: not set), to be fitted to the prompt by `fit_max_tokens`."""
        check_fields(req, self.caps.accept_unknown_fields)
        self.check_model(req.model)
        if not 1 <= req.n <= self.caps.max_n:
            raise ApiError(400, f"n must be between 1 and {self.caps.max_n}", "n")
        req.check_limits(self.caps)
        if max_tokens is not None and max_tokens < 1:
            raise ApiError(400, "max_tokens must be at least 1", "max_tokens")
        return max_tokens

    def fit_max_tokens(self, asked: int | None, prompt_tokens: int, param: str = "max_tokens") -> int:
        """max_tokens for a prompt of `prompt_tokens`: as asked, if the context holds both (else a 400
        naming `param`, as vLLM answers, never a silent clip); unset, `ingress.default_max_tokens`
        bounded by the rest of the context."""
        room = self.max_model_len - prompt_tokens
        if asked is None:
            return min(self.caps.default_max_tokens, room)
        if asked > room:
            raise ApiError(400, f"{param} ({asked}) + prompt tokens ({prompt_tokens}) exceeds the model's context "
                                f"length ({self.max_model_len}); ask for at most {room}", param)
        return asked



def _max_chars(tokenizer, max_model_len: int) -> int | None:
    """Most characters a text of `max_model_len` tokens can have: no token stands for more characters than
    its own string has (byte-level tokens: one character per byte; a byte-fallback `<0x0A>`: six for one),
    so a longer text has more tokens than the context, whatever the tokenizer does with it. None: no
    tokenizer to ask."""
    if tokenizer is None:
        return None
    tokens = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    return max_model_len * max((len(t) for t in tokens if t), default=1)


def check_text(text: str, param: str) -> None:
    """JSON can carry lone surrogates ("\\ud800"), which are not text: a 400 naming the field."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ApiError(400, f"{param} is not valid Unicode (it holds a lone surrogate)", param) from None
