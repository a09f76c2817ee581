"""A conversation through the chat template, with the request's template options (vLLM's chat extras):
`add_generation_prompt`, `continue_final_message`, `chat_template_kwargs` and `add_special_tokens`.

Every option has an effect or is a 400 naming it: a `chat_template_kwargs` key must be a variable the
template reads (one it never reads would be dropped silently), and none may override what the render
sets itself (the messages, the tools, the special tokens, the two flags that are request fields).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import jinja2
import jinja2.meta

from cluster.frontend.http.protocol import ApiError

# Variables the render sets itself: a kwarg may not replace them.
_RENDER_OWN = frozenset({"messages", "tools", "documents", "add_generation_prompt", "continue_final_message",
                         "raise_exception", "strftime_now", "bos_token", "eos_token", "unk_token", "sep_token",
                         "pad_token", "cls_token", "mask_token", "additional_special_tokens"})


@dataclass(frozen=True)
class TemplateOptions:
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    kwargs: dict = field(default_factory=dict)  # chat_template_kwargs, checked against the template (`check`)
    add_special_tokens: bool = False  # the template writes the special tokens it wants (BOS included)

    def check(self, template_variables: frozenset[str] | None, messages: list[dict]) -> None:
        """A 400 naming the option that cannot work with this template or conversation."""
        if self.add_generation_prompt and self.continue_final_message:
            raise ApiError(400, "continue_final_message continues the last message, so it needs "
                                "add_generation_prompt: false", "continue_final_message")
        if self.continue_final_message and (not messages or messages[-1].get("role") != "assistant"):
            raise ApiError(400, "continue_final_message needs the last message to be the assistant's",
                           "continue_final_message")
        for key in self.kwargs:
            if key in _RENDER_OWN:
                raise ApiError(400, f"chat_template_kwargs.{key} is set by the server (the messages, tools, "
                                    "special tokens, or a request field of its own)", f"chat_template_kwargs.{key}")
            if template_variables is not None and key not in template_variables:
                raise ApiError(400, f"chat_template_kwargs.{key} is not a variable of this model's chat template "
                                    f"(it reads: {', '.join(sorted(template_variables - _RENDER_OWN)) or 'none'})",
                               f"chat_template_kwargs.{key}")


def template_variables(template) -> frozenset[str] | None:
    """The variables a Jinja chat template reads (None: unknown, e.g. a template that uses tags of an
    extension this parser lacks, or a tokenizer with several named templates)."""
    if not isinstance(template, str):
        return None
    env = jinja2.Environment(extensions=["jinja2.ext.loopcontrols"])
    try:
        return frozenset(jinja2.meta.find_undeclared_variables(env.parse(template)))
    except jinja2.TemplateSyntaxError:
        return None


def render(tokenizer, template: str | None, messages: list[dict], tools: list[dict] | None,
           options: TemplateOptions, check_chars: Callable[[int], None] | None = None) -> list[int]:
    """The conversation's token ids (call it off the event loop). A `developer` message is a system
    message under OpenAI's newer name: templates know only the old. `check_chars` sees the rendered
    text's length before it is tokenized (and may refuse it)."""
    messages = [{**m, "role": "system"} if m.get("role") == "developer" else m for m in messages]
    try:
        text = tokenizer.apply_chat_template(messages, tools=tools, chat_template=template, tokenize=False,
                                             add_generation_prompt=options.add_generation_prompt,
                                             continue_final_message=options.continue_final_message,
                                             **options.kwargs)
    except Exception as exc:  # a template that rejects the conversation is the client's error
        raise ApiError(400, f"messages: {exc}", "messages") from None
    if check_chars is not None:
        check_chars(len(text))
    return tokenizer.encode(text, add_special_tokens=options.add_special_tokens)
