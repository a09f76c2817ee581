"""Fixtures of the cluster tests."""

from __future__ import annotations

import pytest

from actors.engine.engine import Engine
from tests.helpers.cluster import load, workload
from tests.helpers.http_server import serving


@pytest.fixture(scope="module")
def expected():
    """The single-process engine's greedy tokens for `workload()`: what every layout must reproduce."""
    prompts, params = workload()
    engine = Engine(load("local.yaml").engine_config())
    return [r.outputs[0].token_ids for r in engine.generate(prompts, params)]


@pytest.fixture(scope="module")
def server(ray_session):
    """A live 1P+1D cluster behind the HTTP ingress, one per test module: (cluster, base URL)."""
    config = load("local.yaml")
    config = config.model_copy(update={"scheduler": config.scheduler.model_copy(update={"queue_timeout_s": 1.0})})
    with serving(config) as live:
        yield live
