"""DeepSeek-V3 (multi-head latent attention) through a cluster: colocated and 1P+1D give the
single-process engine's greedy tokens, every prompt prefilled on the prefill pool and its MLA pages (one
latent row a token a layer) crossing the handoff. The bytes the handoff moved are measured and printed
beside the formulas: layers x (kv_lora_rank + qk_rope_head_dim) x dtype bytes a token for MLA, where
per-head K and V would be layers x heads x (qk_head_dim + v_head_dim) x dtype bytes. Then a TP1 prefill
hands off to a TP2 decode worker: each decode rank holds the whole latent (its heads are split, the
latent is not) and receives every page once; and a TP2 prefill sends each page from its rank 0 alone.
On 2P+2D, with structured output and a migration: test_new_families_2p2d.py."""

from __future__ import annotations

import pytest
import ray

from actors.engine.engine import Engine
from cluster.control.lifecycle.launch import Cluster
from cluster.frontend.open_client import open_client
from tests.helpers.cluster import load, wait_until_idle, workload

pytestmark = pytest.mark.slow  # four clusters


def _config(name: str, model_dir, prefill_tp: int = 1, decode_tp: int = 1):
    config = load(name)
    return config.model_copy(update={
        "model": config.model.model_copy(update={"path": str(model_dir)}),
        "scheduler": config.scheduler.model_copy(update={"local_prefill": False}),
        "prefill": config.prefill.model_copy(update={"tensor_parallel_size": prefill_tp}),
        "decode": config.decode.model_copy(update={"tensor_parallel_size": decode_tp}),
    })


def _prompts(n: int):
    prompts, params = workload(n)
    return [[t % 400 for t in p] for p in prompts], params  # the test model's vocabulary


def _bytes_moved(cluster: Cluster, worker_id: str) -> list[tuple[int, int]]:
    """(sent, received) page bytes of each rank of a worker."""
    worker = cluster.workers[worker_id]
    ranks = [worker, *ray.get(worker.tensor_parallel_ranks.remote(), timeout=30)]
    return ray.get([r.kv_bytes.remote() for r in ranks], timeout=30)


@pytest.mark.parametrize("layout, prefill_tp, decode_tp",
                         [("colocated.yaml", 1, 1), ("local.yaml", 1, 1), ("local.yaml", 1, 2), ("local.yaml", 2, 1)],
                         ids=["colocated", "1P+1D", "1P+1D-decode-tp2", "1P+1D-prefill-tp2"])
def test_deepseek_v3_matches_the_engine_and_hands_off_latent_pages(ray_session, hf_models, layout, prefill_tp,
                                                                   decode_tp, capsys):
    prompts, params = _prompts(12)
    engine = Engine(_config("local.yaml", hf_models["deepseek-v3"]).engine_config())
    expected = [r.outputs[0].token_ids for r in engine.generate(prompts, params)]
    assert engine.kv_heads == (1, ((0, 1),))  # one latent "head"
    cluster = Cluster.start(_config(layout, hf_models["deepseek-v3"], prefill_tp, decode_tp))
    try:
        got = open_client(cluster).generate(prompts, params, timeout_s=240)
        assert [r[0].token_ids for r in got] == expected
        state = wait_until_idle(cluster)
        assert all(w["used_blocks"] == 0 and w["reserved"] == 0 and w["held"] == 0
                   for w in state["workers"].values()), state["workers"]
        adopted = sum(w["adopted"] for w in state["workers"].values())
        assert adopted == sum(w["transfers_sent"] for w in state["workers"].values())
        moved = None if layout == "colocated.yaml" else (_bytes_moved(cluster, "prefill-0"),
                                                         _bytes_moved(cluster, "decode-0"))
    finally:
        cluster.shutdown()
    if moved is None:
        return
    sent, received = [s for s, _ in moved[0]], [r for _, r in moved[1]]
    cfg, block_size = engine.runner.cfg, engine.config.block_size
    mla_per_token = cfg.num_layers * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * 4
    mha_per_token = cfg.num_layers * cfg.num_heads * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim + cfg.v_head_dim) * 4
    # Whole blocks of latent rows, nothing per head; with a TP2 decode each rank received every page once,
    # and of a TP2 prefill only rank 0 sent (the latent is a head both ranks hold: the lowest sends it).
    assert len(received) == decode_tp and len(set(received)) == 1 and sent[0] == sum(received) > 0
    assert len(sent) == prefill_tp and not any(sent[1:])
    assert received[0] % (block_size * mla_per_token) == 0
    tokens = received[0] // mla_per_token
    with capsys.disabled():
        print(f"\n{layout} prefill TP{prefill_tp} decode TP{decode_tp}: each decode rank received {received[0]} bytes for {tokens} token "
              f"slots ({tokens // block_size} blocks of {block_size}): {mla_per_token} bytes a token (MLA: layers x "
              f"(kv_lora_rank + rope) x 4); per-head K and V would have been {mha_per_token} a token")

