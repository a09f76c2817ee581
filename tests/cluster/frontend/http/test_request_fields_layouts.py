"""The request fields served since issue 35 give the single-process engine's greedy answer in every
layout: colocated, 1P+1D with every prefill on the prefill worker (the first token sampled there, the rest
on the decode worker after the handoff), and a stream whose decode worker dies mid-way (migrated)."""

from __future__ import annotations

import httpx
import openai
import pytest
import ray

from actors.engine.engine import Engine
from actors.protocol.sampling_params import SamplingParams
from tests.helpers.cluster import load, wait_until_idle
from tests.helpers.http_server import MODEL, serving

pytestmark = pytest.mark.slow  # two more clusters

PROMPT = "Once upon a time in a quiet village"
ALLOWED = [300, 301, 302, 303, 304, 305]
ANSWERED = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hel"}]


@pytest.fixture(scope="module")
def engine():
    return Engine(load("local.yaml").engine_config())


def _greedy(engine, ids, **params) -> str:
    (out,) = engine.generate([ids], SamplingParams(temperature=0.0, ignore_eos=True, **params))
    return out.outputs[0].text


def _check(client, engine) -> None:
    tok = engine.tokenizer
    ids = tok.encode(PROMPT)

    def text(**body) -> str:
        return client.completions.create(model=MODEL, prompt=PROMPT, temperature=0,
                                         extra_body={"ignore_eos": True, **body}).choices[0].text

    assert text(max_tokens=12, allowed_token_ids=ALLOWED) == _greedy(engine, ids, max_tokens=12,
                                                                    allowed_token_ids=tuple(ALLOWED))
    free = _greedy(engine, ids, max_tokens=16)
    word = free[len(free) // 2:len(free) // 2 + 3]
    assert text(max_tokens=16, stop=[word], include_stop_str_in_output=True) == free[:free.index(word)] + word
    assert text(max_tokens=10, truncate_prompt_tokens=4) == _greedy(engine, ids[-4:], max_tokens=10)
    template = tok.apply_chat_template(ANSWERED, tokenize=False, continue_final_message=True)
    chat = client.chat.completions.create(model=MODEL, messages=ANSWERED, max_tokens=10, temperature=0, extra_body={
        "ignore_eos": True, "add_generation_prompt": False, "continue_final_message": True})
    assert chat.choices[0].message.content == _greedy(engine, tok.encode(template, add_special_tokens=False),
                                                      max_tokens=10)


@pytest.mark.parametrize("layout, local_prefill", [("colocated.yaml", True), ("local.yaml", False)])
def test_fields_in_every_layout(ray_session, engine, layout, local_prefill):
    config = load(layout)
    config = config.model_copy(update={"scheduler": config.scheduler.model_copy(update={"local_prefill": local_prefill})})
    with serving(config) as (cluster, base):
        _check(openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=120), engine)
        state = wait_until_idle(cluster, timeout_s=30)
    assert all(w["used_blocks"] == w["reserved"] == 0 for w in state["workers"].values())


def test_allowed_token_ids_survive_a_migration(ray_session, engine):
    config = load("local.yaml")
    config = config.model_copy(update={"scheduler": config.scheduler.model_copy(update={"local_prefill": False})})
    with serving(config) as (cluster, base):
        client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=120)
        stream = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=120, temperature=0, stream=True,
                                           extra_body={"ignore_eos": True, "allowed_token_ids": ALLOWED})
        chunks = []
        for chunk in stream:
            chunks.append(chunk)
            if len(chunks) == 5:
                ray.kill(cluster.workers["decode-0"], no_restart=False)  # Ray restarts it; the request migrates
        metrics = httpx.get(base + "/metrics", timeout=10).text.splitlines()
    moves = [line for line in metrics if line.startswith("tandem:request_migrations_total")]
    assert moves and float(moves[0].split()[-1]) >= 1, moves
    expected = _greedy(engine, engine.tokenizer.encode(PROMPT), max_tokens=120, allowed_token_ids=tuple(ALLOWED))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected
