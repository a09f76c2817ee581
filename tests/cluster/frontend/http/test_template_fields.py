"""`reasoning_effort` and `verbosity` (Responses: `reasoning.effort`, `text.verbosity`) reach a chat
template that reads them, as gpt-oss's does: the prompt is the template rendered with them, on chat and on
Responses alike. (A template that never reads them refuses them by name: test_request_fields.py,
test_responses_fields.py.) A second ingress on the module's cluster, with the tiny model's template plus
the two variables."""

from __future__ import annotations

import openai
import pytest
from transformers import AutoTokenizer

from actors.engine.text.tokenizer import DEFAULT_TOKENIZER_DIR

from cluster.control.config import IngressSection
from cluster.frontend.http.server import make_server
from tests.helpers.http_server import MODEL, running

ASK = [{"role": "user", "content": "Hello there"}]
READS_THEM = "{% if reasoning_effort is defined %}<|system|>\nReasoning: {{ reasoning_effort }}<|end|>\n{% endif %}" \
             "{% if verbosity is defined %}<|system|>\nVerbosity: {{ verbosity }}<|end|>\n{% endif %}"


@pytest.fixture(scope="module")
def setup(server, tmp_path_factory):
    tokenizer = AutoTokenizer.from_pretrained(DEFAULT_TOKENIZER_DIR)
    template = READS_THEM + tokenizer.chat_template
    path = tmp_path_factory.mktemp("template") / "reads-effort.jinja"
    path.write_text(template)
    with running(make_server(server[0], "127.0.0.1", 0, IngressSection(chat_template=str(path)))) as url:
        yield openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0), tokenizer, template


def rendered(setup, **variables) -> int:
    _, tokenizer, template = setup
    text = tokenizer.apply_chat_template(ASK, chat_template=template, tokenize=False, add_generation_prompt=True,
                                         **variables)
    return len(tokenizer.encode(text, add_special_tokens=False))


def chat_tokens(setup, **body) -> int:
    return setup[0].chat.completions.create(model=MODEL, messages=ASK, max_tokens=1, extra_body=body).usage.prompt_tokens


def responses_tokens(setup, **body) -> int:
    return setup[0].responses.create(model=MODEL, input=ASK, max_output_tokens=1, extra_body=body).usage.input_tokens


def test_reasoning_effort_and_verbosity_reach_the_template(setup):
    plain = rendered(setup)
    assert chat_tokens(setup) == responses_tokens(setup) == plain
    assert chat_tokens(setup, reasoning_effort="high") == responses_tokens(setup, reasoning={"effort": "high"}) \
        == rendered(setup, reasoning_effort="high") > plain
    assert chat_tokens(setup, verbosity="low") == responses_tokens(setup, text={"verbosity": "low"}) \
        == rendered(setup, verbosity="low") > plain


def test_set_twice_is_a_400(setup):
    with pytest.raises(openai.BadRequestError) as bad:
        chat_tokens(setup, reasoning_effort="low", chat_template_kwargs={"reasoning_effort": "high"})
    assert bad.value.body["param"] == "reasoning_effort" and "set twice" in bad.value.body["message"]
