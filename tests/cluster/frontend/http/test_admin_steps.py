"""`GET /admin/steps`: every worker's recent engine steps, timed end to end, through the ingress (the
admin check of any `/admin/*` route), and the cost model fitted on them (`tandem plan profile
--from-server`): the prefill worker's steps are prompts, the decode worker's one token per sequence, and
every step's period covers its engine time. And mode slo's online fit of the same logs."""

from __future__ import annotations

import httpx
import openai
import pytest

from cluster.control.autoscale.fit import fit_worker_steps
from cluster.control.autoscale.profile import BatchShape
from experiments.planner.from_server import fetch_steps
from tests.helpers.cluster import load
from tests.helpers.http_server import MODEL, serving

def _generated_key() -> dict[str, str]:
    from cluster.frontend.admin_key import read_generated_key

    return {"Authorization": f"Bearer {read_generated_key()}"}


PROMPTS = [f"step log prompt {i} " * (20 + 10 * i) for i in range(4)]


@pytest.fixture(scope="module")
def served(ray_session):
    config = load("local.yaml")
    config = config.model_copy(update={"scheduler": config.scheduler.model_copy(update={"local_prefill": False})})
    with serving(config) as (cluster, url):
        yield cluster, url


def test_the_workers_steps_come_back_by_role_and_fit(served):
    cluster, url = served
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    for prompt in PROMPTS:
        out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0.0,
                                        extra_body={"ignore_eos": True})
        assert out.usage.completion_tokens == 12
    body = httpx.get(url + "/admin/steps", headers=_generated_key(), timeout=60).json()
    roles = {w["worker_id"]: w["role"] for w in body["workers"]}
    assert sorted(roles.values()) == ["decode", "prefill"], body
    prefill, decode = fetch_steps(url, role="prefill"), fetch_steps(url, role="decode")
    assert prefill and all(s.prefill_tokens and not s.decode_seqs for s in prefill)
    assert sum(s.prefill_samples for s in prefill) == len(PROMPTS)
    # The decode worker adopts each prompt's KV with its first token and computes the other 11.
    assert all(s.decode_seqs and not s.prefill_tokens for s in decode)
    assert sum(s.decode_seqs for s in decode) == 11 * len(PROMPTS)
    assert all(s.period_s >= s.engine_s > 0 for s in prefill + decode)
    cost, used = fit_worker_steps(prefill + decode)
    assert used["prefill_steps"] == len(prefill) and used["decode_steps"] == len(decode)
    # Every logged step is predicted to take time. (The non-negative fit may put a kind's cost on any of its
    # terms: the old check, base + per-sequence/per-token > 0, failed once on a loaded box.)
    for step in prefill + decode:
        shape = BatchShape(prefill_tokens=step.prefill_tokens, prefill_pairs=step.prefill_pairs,
                           decode_seqs=step.decode_seqs, decode_context=step.decode_context)
        assert cost.step_s(shape, None) > 0, (step, cost)
    cluster.check_integrity()


def test_steps_are_an_admin_route(served):
    cluster, url = served
    local = httpx.get(url + "/admin/steps", timeout=30)
    assert local.status_code == 401  # no key configured: the generated one is needed, from loopback too
    assert httpx.get(url + "/admin/steps", headers=_generated_key(), timeout=30).status_code == 200
    original = cluster.config
    try:
        cluster.config = original.model_copy(update={"ingress": original.ingress.model_copy(update={"admin_key": "k3y"})})
        from cluster.frontend.http.server import make_server
        from tests.helpers.http_server import running

        with running(make_server(cluster, "127.0.0.1", 0)) as keyed:
            assert httpx.get(keyed + "/admin/steps", timeout=30).status_code == 401
            ok = httpx.get(keyed + "/admin/steps", headers={"Authorization": "Bearer k3y"}, timeout=30)
            assert ok.status_code == 200 and len(ok.json()["workers"]) == 2
    finally:
        cluster.config = original
    cluster.check_integrity()


def test_the_autoscaler_model_follows_the_workers_steps(served):
    """Mode slo's online fit (autoscaler.slo.refit): each update takes only the steps logged since the last,
    and the profile it returns keeps the seed's model and limits with the cost fitted on those steps."""
    from cluster.control.autoscale.online_fit import OnlineFit
    from cluster.control.autoscale.profile import EngineLimits, EngineProfile, LinearCost, ModelShape

    cluster, url = served
    seed = EngineProfile("measured", "seed", ModelShape("tiny-llama", 2, 64, 4, 2, 16, 128, 512),
                         LinearCost(1.0, 0.0, 0.0, 1.0, 0.0, 0.0), EngineLimits(16, 4096, 64, 2048))
    fit = OnlineFit(seed)
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    for prompt in PROMPTS:
        client.completions.create(model=MODEL, prompt=prompt + "again", max_tokens=6, temperature=0.0,
                                  extra_body={"ignore_eos": True})
    first = fit.update(dict(cluster.workers))
    assert first is not None and first.source == "worker steps" and first.engine == seed.engine
    assert first.model == seed.model and first.cost.decode_base_s < 1.0  # seconds per step, not the seed's 1 s
    taken = fit.fitted_on["steps"]
    again = fit.update(dict(cluster.workers))  # nothing new was logged: the window is the same
    assert again is not None and fit.fitted_on["steps"] == taken
    client.completions.create(model=MODEL, prompt="one more prompt " * 30, max_tokens=6, temperature=0.0,
                              extra_body={"ignore_eos": True})
    fit.update(dict(cluster.workers))
    assert fit.fitted_on["steps"] > taken
    assert fit.update({}) is not None and fit._seen == {}  # forgotten workers are forgotten here too
    cluster.check_integrity()
