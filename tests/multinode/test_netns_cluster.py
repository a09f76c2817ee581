"""tandem across three hosts (network namespaces with their own addresses): prefill on one, decode on
another, the ingress on the head; KV pages cross hosts over tcp (CURVE), and greedy outputs equal the
single-process engine's."""

from __future__ import annotations

import httpx
import openai
from prometheus_client.parser import text_string_to_metric_families

from actors.engine.engine import Engine
from tests.helpers.cluster import load, workload
from tests.multinode.conftest import API_KEY


def _metric(url: str, name: str) -> dict[tuple, float]:
    text = httpx.get(url + "/metrics", timeout=30).text
    return {tuple(sorted(s.labels.items())): s.value for family in text_string_to_metric_families(text)
            for s in family.samples if s.name == name}


def test_greedy_across_hosts_equals_the_engine(served):
    """Only w1 offers `tandem_prefill` and only w2 `tandem_decode`: the pools cannot share a host, so
    every transfer counted here crossed the bridge."""
    prompts, params = workload(12)
    engine = Engine(load("local.yaml").engine_config())
    expected = [r.outputs[0].text for r in engine.generate(prompts, params)]
    client = openai.OpenAI(base_url=served + "/v1", api_key=API_KEY, max_retries=0, timeout=120)
    for prompt, p, want in zip(prompts, params, expected):
        out = client.completions.create(model="tiny-llama", prompt=prompt, max_tokens=p.max_tokens, temperature=0,
                                        extra_body={"ignore_eos": True})
        assert out.choices[0].text == want
    transfers = {dict(k).get("outcome"): v for k, v in _metric(served, "tandem:kv_transfers").items()}
    assert transfers["sent"] == transfers["adopted"] > 0 and transfers["failed"] == 0, transfers
    assert sum(_metric(served, "tandem:kv_transfer_bytes").values()) > 0
