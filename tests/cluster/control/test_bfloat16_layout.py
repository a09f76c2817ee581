"""1P+1D in bfloat16 (what `tandem serve` runs on a CPU with AVX512-BF16 or AMX): the same greedy tokens as
one bfloat16 engine, the prompt's KV pages handed over as bfloat16.

Exact equality holds for the same reason it does in float32: each row's result depends only on that row
(packed GEMMs, per-sequence attention, per-row norms), not on which other sequences share its step, so the
prefill worker's and the decode worker's batches give the single engine's bits."""

from __future__ import annotations

import torch

from actors.engine.engine import Engine
from cluster.control.lifecycle.launch import Cluster
from cluster.frontend.open_client import open_client
from tests.helpers.cluster import load, wait_until_idle, workload


def _bfloat16(name: str):
    config = load(name)
    return config.model_copy(update={"model": config.model.model_copy(update={"dtype": "bfloat16"})})


def test_disaggregated_bfloat16_matches_the_single_bfloat16_engine(ray_session):
    prompts, params = workload(16)
    config = _bfloat16("local.yaml")
    engine = Engine(config.engine_config())
    assert engine.runner.kv_caches[0][0].dtype == torch.bfloat16
    expected = [r.outputs[0].token_ids for r in engine.generate(prompts, params)]
    cluster = Cluster.start(config)
    try:
        got = open_client(cluster).generate(prompts, params)
        assert [r[0].token_ids for r in got] == expected
        state = wait_until_idle(cluster)
        sent = sum(s["transfers_sent"] for s in state["workers"].values())
        adopted = sum(s["adopted"] for s in state["workers"].values())
        assert sent == adopted > 0
        assert all(s["transfers_failed"] == 0 and s["used_blocks"] == 0 for s in state["workers"].values())
    finally:
        cluster.shutdown()
