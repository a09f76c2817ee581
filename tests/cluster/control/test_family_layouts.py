"""Model families through every layout: a Gemma 2 and a Gemma 3 model (alternating sliding and full
layers; soft caps, or a rope per layer type), a Qwen2 that mixes windowed and full layers, a Qwen3-MoE
(top-3 of 8 experts, one dense layer), a Mistral (a window in every layer: blocks behind it are handed
back while decoding) and a gpt-oss (attention sinks, a window of 8 on every other layer, YaRN, biased
clamped-SwiGLU experts) give the single-process engine's greedy tokens colocated and 1P+1D, the KV
(every layer's, windows included) crossing the handoff. Several workers per pool, and routing among
them, are the same code for every family: tests/cluster/control/test_cluster_parity.py runs 2P+2D."""

from __future__ import annotations

import pytest

from actors.engine.engine import Engine
from cluster.control.lifecycle.launch import Cluster
from cluster.frontend.open_client import open_client
from tests.helpers.cluster import load, wait_until_idle, workload

pytestmark = pytest.mark.slow  # two clusters per model family

LAYOUTS = ["colocated.yaml", "local.yaml"]


def _config(name: str, model_dir):
    config = load(name)
    return config.model_copy(update={"model": config.model.model_copy(update={"path": str(model_dir)})})


@pytest.mark.parametrize("family", ["gemma2", "gemma3", "qwen2-mixed", "qwen3-moe", "mistral", "llama4", "gpt-oss"])
def test_layouts_match_the_engine(ray_session, hf_models, family):
    prompts, params = workload(16)
    prompts = [[t % 300 for t in p] for p in prompts]  # these test models have 300 to 400 tokens
    engine = Engine(_config("local.yaml", hf_models[family]).engine_config())
    expected = [r.outputs[0].token_ids for r in engine.generate(prompts, params)]
    for name in LAYOUTS:
        cluster = Cluster.start(_config(name, hf_models[family]))
        try:
            got = open_client(cluster).generate(prompts, params)
            assert [r[0].token_ids for r in got] == expected, name
            state = wait_until_idle(cluster)
            assert state["scheduler"]["in_flight"] == 0
            assert all(w["used_blocks"] == 0 and w["reserved"] == 0 and w["held"] == 0
                       for w in state["workers"].values()), state["workers"]
            if name != "colocated.yaml":
                adopted = sum(w["adopted"] for w in state["workers"].values())
                assert adopted == sum(w["transfers_sent"] for w in state["workers"].values()) > 0, name
        finally:
            cluster.shutdown()
