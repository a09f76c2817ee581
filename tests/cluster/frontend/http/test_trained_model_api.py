"""The API features that need a model that follows instructions, on SmolLM2-135M-Instruct (colocated,
one worker) through the official `openai` client: `response_format` json_object gives a JSON object the
model fills in itself (unconstrained, the same model wraps its JSON in a markdown fence)."""

from __future__ import annotations

import json

import openai
import pytest

from tests.helpers.cluster import load
from tests.helpers.http_server import serving

SERVED = "smollm2"


@pytest.fixture(scope="module")
def smollm2_server(ray_session, smollm2_dir):
    config = load("colocated.yaml")
    config = config.model_copy(update={
        "model": config.model.model_copy(update={"path": "builtin:smollm2"}),
        "colocated": config.colocated.model_copy(update={"replicas": 1}),
    })
    with serving(config) as live:
        yield live


@pytest.fixture
def client(smollm2_server):
    return openai.OpenAI(base_url=smollm2_server[1] + "/v1", api_key="unused", max_retries=0, timeout=300)


def test_json_object(client):
    messages = [{"role": "user", "content": "Describe a cat as a JSON object with the keys name and age."}]
    out = client.chat.completions.create(model=SERVED, messages=messages, max_tokens=60, temperature=0,
                                         response_format={"type": "json_object"})
    assert out.choices[0].finish_reason == "stop"
    value = json.loads(out.choices[0].message.content)
    assert isinstance(value, dict) and value
    free = client.chat.completions.create(model=SERVED, messages=messages, max_tokens=60, temperature=0)
    assert free.choices[0].message.content != out.choices[0].message.content
