"""The decode worker dies while the official `openai` client streams from it: the stream carries on
after the migration, and the text is the fault-free one, with no token missing or repeated."""

from __future__ import annotations

import httpx
import openai
import pytest
import ray

from actors.engine.engine import Engine
from actors.protocol.sampling_params import SamplingParams
from tests.helpers.cluster import load, wait_until_idle
from tests.helpers.http_server import serving

MODEL = "tiny-llama"


@pytest.fixture(scope="module")
def server(ray_session):
    config = load("local.yaml")
    # Fresh requests wait 1 s for admission; a migrated one waits for the restarted decode worker (several
    # seconds) until its own deadline.
    config = config.model_copy(update={"scheduler": config.scheduler.model_copy(
        update={"queue_timeout_s": 1.0, "local_prefill": False})})
    with serving(config) as live:
        yield live


def test_openai_stream_survives_its_decode_worker(server):
    cluster, base = server
    prompt = "Once upon a time in a quiet village"
    params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
    (ref,) = Engine(load("local.yaml").engine_config()).generate([prompt], params)
    client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=120)
    stream = client.completions.create(model=MODEL, prompt=prompt, max_tokens=200, temperature=0, stream=True,
                                       stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    chunks = []
    for chunk in stream:
        chunks.append(chunk)
        if len(chunks) == 5:
            ray.kill(cluster.workers["decode-0"], no_restart=False)  # Ray restarts it; the request migrates
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert text == ref.outputs[0].text
    assert chunks[-1].usage.completion_tokens == 200
    body = httpx.get(base + "/metrics", timeout=10).text
    migrations = [line for line in body.splitlines() if line.startswith("tandem:request_migrations_total")]
    assert migrations and float(migrations[0].split()[-1]) >= 1, migrations
    state = wait_until_idle(cluster)
    for stats in state["workers"].values():
        assert stats["used_blocks"] == stats["reserved"] == stats["held"] == 0, stats
