"""Fixtures of the HTTP tests against the module's live 1P+1D `server` (tests/cluster/conftest.py): the
single-process engine on the same model, whose outputs they compare with, and the official `openai` client."""

from __future__ import annotations

import openai
import pytest

from actors.engine.engine import Engine
from tests.helpers.cluster import load


@pytest.fixture(scope="module")
def engine(server):
    return Engine(load("local.yaml").engine_config())


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server[1] + "/v1", api_key="unused", max_retries=0)
