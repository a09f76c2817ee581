"""KV runs out on the decode worker: it preempts (recompute) and the requests resume with the same output."""

from __future__ import annotations

import pytest

from actors.engine.engine import Engine
from actors.protocol.sampling_params import SamplingParams
from cluster.control.lifecycle.launch import Cluster
from cluster.frontend.open_client import open_client
from tests.helpers.cluster import load, wait_until_idle

PROMPTS = [list(range(20 + 13 * i, 50 + 13 * i)) for i in range(8)]
PARAMS = SamplingParams(temperature=0.0, max_tokens=120, ignore_eos=True)


@pytest.fixture(scope="module")
def cluster(ray_session):
    # 40 blocks of 16 = 640 slots; the 8 requests need 8 x 150 at their end. Admission reserves only
    # the prompts (`reserve: prompt`), so the decode worker overcommits and must preempt.
    config = load("local.yaml", num_kv_blocks=40)
    config = config.model_copy(update={"scheduler": config.scheduler.model_copy(
        update={"reserve": "prompt", "local_prefill": False})})
    cluster = Cluster.start(config)
    yield cluster
    cluster.shutdown()


def test_decode_side_preemption_keeps_outputs(cluster):
    expected = [r.outputs[0].token_ids for r in Engine(load("local.yaml").engine_config()).generate(PROMPTS, PARAMS)]
    results = open_client(cluster).generate(PROMPTS, PARAMS, timeout_s=300)
    assert [r[0].token_ids for r in results] == expected
    assert all(r[0].finish_reason == "length" for r in results)
    state = wait_until_idle(cluster)
    assert state["workers"]["decode-0"]["preemptions"] > 0
    for stats in state["workers"].values():
        assert stats["used_blocks"] == stats["reserved"] == stats["held"] == 0, stats
