"""`response_format` json_object needs a model that can finish a JSON object by itself (a random one
rambles inside a string until max_tokens), so it runs on SmolLM2-135M-Instruct: through the official
`openai` client its greedy output is a JSON object, and the same text as the single-process engine's,
colocated, 1P+1D and 2P+2D (the first token under the grammar on the prefill worker, the rest on the
decode worker), with no free whitespace."""

from __future__ import annotations

import json

import openai
import pytest

from actors.engine.engine import Engine
from actors.protocol.sampling_params import SamplingParams
from actors.protocol.structured_output import StructuredOutput
from tests.helpers.cluster import load
from tests.helpers.http_server import serving

ASK = [{"role": "user", "content": "Describe a cat as a JSON object with the keys name and age."}]


def _smollm2(layout: str):
    config = load(layout)
    return config.model_copy(update={"model": config.model.model_copy(update={"path": "builtin:smollm2"})})


@pytest.fixture(scope="module")
def expected(smollm2_dir):
    engine = Engine(_smollm2("local.yaml").engine_config())
    prompt = engine.tokenizer.apply_chat_template(ASK, tokenize=False, add_generation_prompt=True)
    ids = engine.tokenizer.encode(prompt, add_special_tokens=False)
    (result,) = engine.generate([ids], SamplingParams(temperature=0.0, max_tokens=60,
                                                      structured_output=StructuredOutput("json_object")))
    return result.outputs[0].text


# The fast tier runs 1P+1D; the other layouts are the slow tier's.
@pytest.mark.parametrize("layout", [pytest.param("colocated.yaml", marks=pytest.mark.slow), "local.yaml",
                                    pytest.param("disagg-2p2d.yaml", marks=pytest.mark.slow)])
def test_json_object_is_the_engines_in_every_layout(ray_session, expected, layout):
    assert isinstance(json.loads(expected), dict)
    # Laid out as a JSON schema's output: no free whitespace, only the ", " and ": " separators.
    assert json.dumps(json.loads(expected), ensure_ascii=False) == expected
    with serving(_smollm2(layout)) as (_, base):
        client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=300)
        out = client.chat.completions.create(model="smollm2", messages=ASK, max_tokens=60, temperature=0,
                                             response_format={"type": "json_object"})
    assert out.choices[0].message.content == expected and out.choices[0].finish_reason == "stop"
