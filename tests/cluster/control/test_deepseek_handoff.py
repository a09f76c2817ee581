"""DeepSeek-V3 (multi-head latent attention) through a cluster: colocated and 1P+1D give the
single-process engine's greedy tokens, every prompt prefilled on the prefill pool and its MLA pages (one
latent row a token a layer) crossing the handoff. The bytes the handoff moved are measured and printed
beside the formulas: layers x (kv_lora_rank + qk_rope_head_dim) x dtype bytes a token for MLA, where
per-head K and V would be layers x heads x (qk_head_dim + v_head_dim) x dtype bytes. Then a TP1 prefill
hands off to a TP2 decode worker: each decode rank holds the whole latent (its heads are split, the
latent is not) and receives every page once."""

from __future__ import annotations

import pytest
import ray

from actors.engine.engine import Engine
from cluster.control.launch import Cluster
from tests.helpers.cluster import load, wait_until_idle, workload

pytestmark = pytest.mark.slow  # two clusters


def _config(name: str, model_dir, decode_tp: int = 1):
    config = load(name)
    return config.model_copy(update={
        "model": config.model.model_copy(update={"path": str(model_dir)}),
        "scheduler": config.scheduler.model_copy(update={"local_prefill": False}),
        "decode": config.decode.model_copy(update={"tensor_parallel_size": decode_tp}),
    })


def _prompts(n: int):
    prompts, params = workload(n)
    return [[t % 400 for t in p] for p in prompts], params  # the test model's vocabulary


@pytest.mark.parametrize("layout", ["colocated.yaml", "local.yaml"])
def test_deepseek_v3_matches_the_engine_and_hands_off_latent_pages(ray_session, hf_models, layout, capsys):
    prompts, params = _prompts(12)
    engine = Engine(_config("local.yaml", hf_models["deepseek-v3"]).engine_config())
    expected = [r.outputs[0].token_ids for r in engine.generate(prompts, params)]
    cfg, block_size = engine.runner.cfg, engine.config.block_size
    mla_per_token = cfg.num_layers * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * 4
    mha_per_token = cfg.num_layers * cfg.num_heads * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim + cfg.v_head_dim) * 4
    cluster = Cluster.start(_config(layout, hf_models["deepseek-v3"]))
    try:
        got = cluster.client().generate(prompts, params)
        assert [r[0].token_ids for r in got] == expected
        state = wait_until_idle(cluster)
        assert all(w["used_blocks"] == 0 and w["reserved"] == 0 and w["held"] == 0
                   for w in state["workers"].values()), state["workers"]
        if layout == "colocated.yaml":
            return
        adopted = sum(w["adopted"] for w in state["workers"].values())
        assert adopted == sum(w["transfers_sent"] for w in state["workers"].values()) > 0
        sent, _ = ray.get(cluster.workers["prefill-0"].kv_bytes.remote(), timeout=30)
        _, received = ray.get(cluster.workers["decode-0"].kv_bytes.remote(), timeout=30)
    finally:
        cluster.shutdown()
    assert sent == received > 0
    assert sent % (block_size * mla_per_token) == 0  # whole blocks of latent rows, nothing per head
    tokens = sent // mla_per_token
    with capsys.disabled():
        print(f"\n1P+1D handoff moved {sent} bytes for {tokens} token slots ({sent // (block_size * mla_per_token)} "
              f"blocks of {block_size}): {mla_per_token} bytes a token (MLA: layers x (kv_lora_rank + rope) x 4); "
              f"per-head K and V would have been {mha_per_token} a token, {tokens * mha_per_token} bytes")


def test_tp1_prefill_hands_latent_pages_to_every_rank_of_a_tp2_decode(ray_session, hf_models):
    prompts, params = _prompts(8)
    config = _config("local.yaml", hf_models["deepseek-v3"], decode_tp=2)
    engine = Engine(config.engine_config())
    expected = [r.outputs[0].token_ids for r in engine.generate(prompts, params)]
    assert engine.kv_heads == (1, ((0, 1),))
    cluster = Cluster.start(config)
    try:
        got = cluster.client().generate(prompts, params, timeout_s=240)
        assert [r[0].token_ids for r in got] == expected
        state = wait_until_idle(cluster)
        assert all(w["used_blocks"] == 0 for w in state["workers"].values()), state["workers"]
        decode = cluster.workers["decode-0"]
        (rank1,) = ray.get(decode.tensor_parallel_ranks.remote(), timeout=30)
        received = [r for _, r in ray.get([decode.kv_bytes.remote(), rank1.kv_bytes.remote()], timeout=30)]
        sent, _ = ray.get(cluster.workers["prefill-0"].kv_bytes.remote(), timeout=30)
    finally:
        cluster.shutdown()
    cfg = engine.runner.cfg
    block_bytes = engine.config.block_size * cfg.num_layers * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * 4
    assert received[0] == received[1] > 0 and received[0] % block_bytes == 0  # whole latent pages, on each rank
    assert sent == sum(received)
