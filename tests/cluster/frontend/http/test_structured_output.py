"""Structured output through the official `openai` client: `response_format` json_schema (nested object,
enum, array, required fields, bounded strings), vLLM's guided_json / guided_regex / guided_choice /
guided_grammar and its `structured_outputs` spelling. Every output validates, and the greedy outputs are
the single-process engine's in colocated, 1P+1D and 2P+2D layouts (the grammar's walk continues on the
decode worker from the prefill worker's first token) and after a forced migration mid-stream. A schema,
regex or grammar that does not compile is a 400 naming the parameter."""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import openai
import pytest
import ray

from actors.engine.engine import Engine
from actors.protocol.sampling_params import SamplingParams
from actors.protocol.structured_output import StructuredOutput
from tests.helpers.cluster import load, wait_until_idle
from tests.helpers.http_server import MODEL, serving

SCHEMA = {
    "type": "object",
    "properties": {
        "answer": {"enum": ["yes", "no"]},
        "score": {"type": "integer", "minimum": 0, "maximum": 9},
        "name": {"type": "string", "maxLength": 12},
        "pet": {"type": "object", "properties": {"kind": {"enum": ["cat", "dog"]}, "legs": {"type": "integer",
                "minimum": 0, "maximum": 4}}, "required": ["kind", "legs"], "additionalProperties": False},
        "tags": {"type": "array", "items": {"enum": ["red", "blue"]}, "maxItems": 3},
    },
    "required": ["answer", "score", "name", "pet", "tags"],
    "additionalProperties": False,
}
REGEX = r"[0-9]{3}-[a-z]{2,6}"
CHOICES = ["yes", "no", "maybe"]
GRAMMAR = 'root ::= "(" digit ("+" digit)* ")"\ndigit ::= [0-9]'
PROMPTS = ["Tell me about it", "A question", "Describe the weather", "One more"]

# (name, the request's structured-output fields, the engine's spec, how to check the text)
CASES = [
    ("json_schema", {"response_format": {"type": "json_schema", "json_schema": {"name": "t", "schema": SCHEMA,
                                                                              "strict": True}}},
     StructuredOutput("json_schema", json.dumps(SCHEMA)), lambda t: jsonschema.validate(json.loads(t), SCHEMA)),
    ("guided_json", {"guided_json": SCHEMA}, StructuredOutput("json_schema", json.dumps(SCHEMA)),
     lambda t: jsonschema.validate(json.loads(t), SCHEMA)),
    ("guided_regex", {"guided_regex": REGEX}, StructuredOutput("regex", REGEX),
     lambda t: _check(re.fullmatch(REGEX, t))),
    ("guided_choice", {"guided_choice": CHOICES}, StructuredOutput("choice", json.dumps(CHOICES)),
     lambda t: _check(t in CHOICES)),
    ("structured_outputs.grammar", {"structured_outputs": {"grammar": GRAMMAR}}, StructuredOutput("grammar", GRAMMAR),
     lambda t: _check(re.fullmatch(r"\([0-9](\+[0-9])*\)", t))),
]


def _check(ok) -> None:
    assert ok


@pytest.fixture(scope="module")
def expected():
    engine = Engine(load("local.yaml").engine_config())
    return {name: [r.outputs[0].text for r in engine.generate(PROMPTS, SamplingParams(
        temperature=0.0, max_tokens=120, structured_output=spec))] for name, _, spec, _ in CASES}


def _outputs(base: str) -> dict[str, list[str]]:
    client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=120)
    out = {}
    for name, fields, _, check in CASES:
        out[name] = []
        for prompt in PROMPTS:
            choice = client.completions.create(model=MODEL, prompt=prompt, max_tokens=120, temperature=0,
                                               extra_body=fields).choices[0]
            assert choice.finish_reason == "stop", (name, choice.text)
            check(choice.text)
            out[name].append(choice.text)
    return out


# The fast tier runs 1P+1D; the other layouts are the slow tier's.
@pytest.mark.parametrize("layout", [pytest.param("colocated.yaml", marks=pytest.mark.slow), "local.yaml",
                                    pytest.param("disagg-2p2d.yaml", marks=pytest.mark.slow)])
def test_outputs_validate_and_match_the_engine_in_every_layout(ray_session, expected, layout):
    with serving(load(layout)) as (cluster, base):
        assert _outputs(base) == expected
        client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=120)
        chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=120,
                                              temperature=0, response_format=CASES[0][1]["response_format"])
        jsonschema.validate(json.loads(chat.choices[0].message.content), SCHEMA)
        wait_until_idle(cluster)


@pytest.mark.parametrize("fields, param, words", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "t", "schema": {"type": "objec"}}}},
     "response_format", "does not compile"),
    ({"guided_regex": "[0-9"}, "guided_regex", "does not compile"),
    ({"guided_grammar": "root ::= missing"}, "guided_grammar", "does not compile"),
    ({"guided_choice": []}, "guided_choice", "non-empty list"),
    ({"guided_json": "{not json"}, "guided_json", "guided_json"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice", "give one structured output"),
])
def test_bad_specs_are_a_400_naming_the_parameter(server, fields, param, words):
    client = openai.OpenAI(base_url=server[1] + "/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model=MODEL, prompt="x", max_tokens=4, extra_body=fields)
    assert bad.value.body["param"] == param and words in bad.value.body["message"], bad.value.body


def test_migration_mid_stream_keeps_the_grammar(server):
    """The decode worker dies after a few chunks: the migrated request's new worker rebuilds the grammar's
    walk from the tokens already sent, and the text is the fault-free one."""
    keys = "abcdefghijklmnop"  # ~250 tokens: the stream is still running when the worker dies
    long_schema = {"type": "object", "properties": {k: {"type": "string", "minLength": 40, "maxLength": 44}
                                                    for k in keys},
                   "required": list(keys), "additionalProperties": False}
    spec = StructuredOutput("json_schema", json.dumps(long_schema))
    (ref,) = Engine(load("local.yaml").engine_config()).generate(
        ["Once upon a time"], SamplingParams(temperature=0.0, max_tokens=600, structured_output=spec))
    cluster, base = server
    client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=120)
    chunks = []
    for chunk in client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=600, temperature=0,
                                           stream=True, extra_body={"guided_json": long_schema}):
        chunks.append(chunk)
        if len(chunks) == 5:
            ray.kill(cluster.workers["decode-0"], no_restart=False)  # Ray restarts it; the request migrates
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == ref.outputs[0].text
    jsonschema.validate(json.loads(text), long_schema)
    metrics = httpx.get(base + "/metrics", timeout=10).text.splitlines()
    migrations = [line for line in metrics if line.startswith("tandem:request_migrations_total")]
    assert migrations and float(migrations[0].split()[-1]) >= 1, migrations
    wait_until_idle(cluster)
