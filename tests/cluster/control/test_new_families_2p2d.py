"""The families whose KV pages differ most (Llama 4's chunked layers, gpt-oss's sinks and windows,
DeepSeek-V3's latent pages) on 2P+2D: greedy requests and json_object ones (the grammar over a real
tokenizer) give the single-process engine's tokens while routing picks among two workers per pool; then
a stream whose decode worker is lost moves (its prompt and tokens so far prefilled again and handed off
again) and ends with the engine's tokens. Colocated and 1P+1D run in test_family_layouts.py and
test_deepseek_handoff.py."""

from __future__ import annotations

import pytest
import ray

from actors.engine.engine import Engine
from actors.protocol.sampling_params import SamplingParams
from actors.protocol.structured_output import StructuredOutput
from cluster.control.lifecycle.launch import Cluster
from cluster.frontend.open_client import open_client
from tests.helpers.cluster import load, wait_until_idle, workload
from tests.helpers.models import make_hf_model

pytestmark = pytest.mark.slow  # a 2P+2D cluster per family

FAMILIES = ["llama4", "gpt-oss", "deepseek-v3"]
JSON = SamplingParams(temperature=0.0, max_tokens=24, structured_output=StructuredOutput("json_object"))
LONG = SamplingParams(temperature=0.0, max_tokens=300, ignore_eos=True)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Each family with the default tokenizer (the grammar needs one) and its vocabulary."""
    root = tmp_path_factory.mktemp("new-families")
    return {f: make_hf_model(root / f, f, seed=i, with_tokenizer=True, vocab_size=2048) for i, f in enumerate(FAMILIES)}


def _config(model_dir):
    config = load("disagg-2p2d.yaml")
    return config.model_copy(update={
        "model": config.model.model_copy(update={"path": str(model_dir)}),
        "scheduler": config.scheduler.model_copy(update={"local_prefill": False}),  # every prompt handed off
    })


@pytest.mark.parametrize("family", FAMILIES)
def test_2p2d_structured_output_and_a_migration_match_the_engine(ray_session, models, family):
    prompts, params = workload(12)
    prompts += prompts[:4]
    params += [JSON] * 4
    config = _config(models[family])
    engine = Engine(config.engine_config())
    expected = [r.outputs[0].token_ids for r in engine.generate(prompts, params)]
    moving = list(range(30, 50))
    (moved_expected,) = engine.generate([moving], LONG)
    cluster = Cluster.start(config)
    try:
        client = open_client(cluster)
        got = client.generate(prompts, params, timeout_s=300)
        assert [r[0].token_ids for r in got] == expected
        assert all(got[i][0].token_ids for i in range(12, 16)), "a json_object request generated nothing"
        state = wait_until_idle(cluster)
        adopted = sum(w["adopted"] for w in state["workers"].values())
        assert adopted == sum(w["transfers_sent"] for w in state["workers"].values()) >= len(prompts)

        submitted = client.submit(moving, LONG)
        stream = client.events(submitted, timeout_s=300)
        events = [next(stream) for _ in range(3)]
        decode = submitted.route.decode
        ray.kill(cluster.workers[decode], no_restart=False)  # Ray restarts it; it registers again
        events += list(stream)
        assert events[-1].finished and events[-1].finish_reason == "length", events[-1]
        assert [t for ev in events for t in ev.token_ids] == moved_expected.outputs[0].token_ids
        assert submitted.stream.moves >= 1, "the stream was never migrated: the worker died after it ended"
        cluster.wait_registered(set(cluster.workers), timeout_s=120)
        wait_until_idle(cluster)
    finally:
        cluster.shutdown()
