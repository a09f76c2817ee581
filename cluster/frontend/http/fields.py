"""No request field is dropped silently: every field a request body sends is honoured, or refused with a
400 naming it.

The request models keep the fields they do not declare (`extra="allow"`), and `check_fields` decides on
them before anything runs:
- a field of OpenAI's or vLLM's schemas that this server does not honour (`REFUSED`) is a 400 naming it,
  unless it holds its neutral value, the one that asks for nothing (`echo: false`, `use_beam_search: false`);
- any other field is unknown: a 400 naming it (`ingress.unknown_fields: reject`, the default), or, for
  clients that send vendor extras (`accept`), a WARNING naming it, once per request.
A field sent as null asks for nothing and is not looked at. The parameter objects (`stream_options`,
`response_format`, ...) are checked the same way; messages and tool definitions are data for the chat
template, which receives them whole. A route whose request holds objects of its own (the Responses API's
input items, content parts and `text`: responses_request.py) decides their keys itself, with its own list
of refused fields, and hands the unknown keys it found to the same decision.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from pydantic import BaseModel

from cluster.frontend.http.protocol import ApiError

log = logging.getLogger("tandem.ingress")

# name -> its neutral values. OpenAI's and vLLM's fields whose effect this server does not produce.
REFUSED: dict[str, tuple] = {
    # vLLM's sampling extras
    "use_beam_search": (False,), "length_penalty": (1.0,), "early_stopping": (False,), "bad_words": ([],),
    "logits_processors": ([],), "spaces_between_special_tokens": (True,),
    "prompt_embeds": (), "guided_decoding_backend": (), "guided_whitespace_pattern": (),
    "structural_tag": (), "logprobs_mode": (),
    # vLLM's chat and completions extras
    "echo": (False,),  # chat's (the last message prepended to the answer); completions' echo is served
    "suffix": ("",), "chat_template": (), "documents": ([],), "mm_processor_kwargs": ({},),
    "return_token_ids": (False,), "kv_transfer_params": (), "cache_salt": (), "vllm_xargs": ({},),
    # OpenAI's
    "functions": ([],), "function_call": ("none",), "store": (False,), "audio": (),
    "modalities": (["text"],), "prediction": (), "web_search_options": (),
    # chat's template variables (declared there), not completions'
    "reasoning_effort": (), "verbosity": (),
}


def check_fields(req: BaseModel, accept_unknown: bool, refused: dict[str, tuple] = REFUSED,
                 inner_unknown: Sequence[str] = ()) -> None:
    """The 400 for the first `refused` field of `req` (and its parameter objects), then for its unknown
    ones, all named: its own, then `inner_unknown` (the unknown keys a route found inside objects of its
    own); unless `accept_unknown`: then they are logged."""
    unknown: list[str] = []
    for path, value in _extras(req, ""):
        name = path.rsplit(".", 1)[-1]
        if path == name and name in refused:
            if value not in refused[name]:
                raise ApiError(400, f"{name} is not supported by this server"
                               + (f" (only {neutral(refused[name])} is accepted)" if refused[name] else ""), name)
        else:
            unknown.append(path)
    unknown += inner_unknown
    if not unknown:
        return
    if accept_unknown:
        log.warning("ignoring unknown request field(s) (ingress.unknown_fields: accept): %s", ", ".join(unknown))
        return
    raise ApiError(400, f"unknown field{'s' if len(unknown) > 1 else ''}: {', '.join(unknown)} (the server honours "
                   "every field it accepts; set ingress.unknown_fields: accept to let unknown ones through)",
                   unknown[0])


def _extras(model: BaseModel, prefix: str):
    """(dotted path, value) of every undeclared non-null field of `model` and its parameter objects."""
    for name, value in (model.model_extra or {}).items():
        if value is not None:
            yield prefix + name, value
    for name in type(model).model_fields:
        value = getattr(model, name)
        if isinstance(value, BaseModel):
            yield from _extras(value, f"{prefix}{name}.")


def neutral(values: tuple) -> str:
    """Neutral values as a request writes them (JSON)."""
    return " or ".join(repr(v).replace("True", "true").replace("False", "false") for v in values)
