"""The `ray up` configs: valid for Ray's launcher, and the pool config they start lands on their GPU nodes.

No cloud here, so the checks are offline: Ray's own JSON schema for launcher configs, tandem's config
loader for the pool config the head starts, and the autoscaler's placement rule (a worker goes to a
node type that offers every resource it asks for) applied to the declared node types.
"""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import jsonschema
import pytest
import ray
import yaml

from cluster.control.config import PoolSection, TandemConfig

REPO = Path(__file__).resolve().parents[2]
# The cloud launchers (GPU node types per pool). configs/cluster-local.yaml (machines you already have,
# Ray's local provider) has no node types to check here: tests/multinode/test_ray_up.py runs it.
LAUNCHER_CONFIGS = sorted(p for p in (REPO / "configs").glob("cluster-*.yaml") if p.name != "cluster-local.yaml")
RAY_SCHEMA = Path(ray.__file__).parent / "autoscaler" / "ray-schema.json"


def test_there_is_a_launcher_config_per_cloud():
    assert [p.name for p in LAUNCHER_CONFIGS] == ["cluster-aws.yaml", "cluster-gcp.yaml"]


def _load(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


def _remote_to_local(launcher: dict, remote_path: str) -> Path:
    """A path on the cluster's nodes -> the local file that file_mounts copies there."""
    for remote_dir, local_dir in launcher["file_mounts"].items():
        prefix = remote_dir.rstrip("/") + "/"
        if remote_path.startswith(prefix):
            return (REPO / local_dir / remote_path[len(prefix):]).resolve()
    raise AssertionError(f"{remote_path} is not under any file_mounts target: {sorted(launcher['file_mounts'])}")


def _served_pool_config(launcher: dict) -> Path:
    """The --config of the `tandem serve` that the head start commands run."""
    commands = " ".join(launcher["head_start_ray_commands"])
    serve = re.search(r"tandem serve ([^;&'\n]*)", commands)
    assert serve, "no head start command runs `tandem serve`"
    args = shlex.split(serve.group(1))
    assert args[args.index("--address") + 1] == "auto", "tandem serve must join the head's Ray"
    # The head's loopback: `ray attach -p` tunnels to it, and no key-less ingress faces the network.
    assert args[args.index("--host") + 1] == "127.0.0.1"
    return _remote_to_local(launcher, args[args.index("--config") + 1])


def _offers(node_type: dict, pool: PoolSection) -> bool:
    """Whether one worker of `pool` fits a node of this type (the autoscaler's bin-packing test)."""
    needs = {"CPU": pool.num_cpus, "GPU": pool.num_gpus, **pool.resources}
    offered = node_type["resources"]
    return all(amount == 0 or offered.get(name, 0) >= amount for name, amount in needs.items())


def _hosts(launcher: dict, pool: PoolSection) -> list[str]:
    return [name for name, node_type in launcher["available_node_types"].items() if _offers(node_type, pool)]


@pytest.mark.parametrize("path", LAUNCHER_CONFIGS, ids=lambda p: p.name)
def test_launcher_config_passes_rays_schema(path):
    validator = jsonschema.Draft7Validator(json.loads(RAY_SCHEMA.read_text()))
    errors = [f"{'/'.join(map(str, e.absolute_path)) or '<top>'}: {e.message}" for e in validator.iter_errors(_load(path))]
    assert errors == []


@pytest.mark.parametrize("path", LAUNCHER_CONFIGS, ids=lambda p: p.name)
def test_head_starts_a_valid_pool_config(path):
    config = TandemConfig.from_file(_served_pool_config(_load(path)))
    assert config.mode == "disaggregated"
    assert config.transfer.zmq_transport == "tcp", "workers on separate machines cannot use ipc"


@pytest.mark.parametrize("path", LAUNCHER_CONFIGS, ids=lambda p: p.name)
def test_each_pool_lands_only_on_its_own_gpu_node_type(path):
    launcher = _load(path)
    config = TandemConfig.from_file(_served_pool_config(launcher))
    head = launcher["head_node_type"]
    hosts = {role: _hosts(launcher, pool) for role, pool in config.pools().items()}
    for role, pool in config.pools().items():
        assert pool.num_gpus >= 1 and pool.resources, f"{role}: a GPU worker pinned to its node type by a custom resource"
        assert len(hosts[role]) == 1, f"{role} fits node types {hosts[role]}; it must fit exactly one"
        (node_type,) = hosts[role]
        assert node_type != head
        assert launcher["available_node_types"][node_type]["max_workers"] >= pool.replicas, (
            f"{node_type} cannot grow to {pool.replicas} nodes for the {role} pool"
        )
    assert hosts["prefill"] != hosts["decode"], "the pools need separate node types to scale apart"


def test_a_pool_asking_for_a_resource_nobody_offers_fits_nowhere():
    launcher = _load(LAUNCHER_CONFIGS[0])
    stray = PoolSection(replicas=1, num_cpus=1, num_gpus=1, resources={"tandem_typo": 1})
    assert _hosts(launcher, stray) == []
    untagged = PoolSection(replicas=1, num_cpus=1, num_gpus=1)
    assert len(_hosts(launcher, untagged)) == 2, "without a custom resource any GPU type would do"


@pytest.mark.parametrize("path", LAUNCHER_CONFIGS, ids=lambda p: p.name)
def test_workers_download_the_checkpoint_where_the_pool_config_reads_it(path):
    launcher = _load(path)
    config = TandemConfig.from_file(_served_pool_config(launcher))
    home = f"/home/{launcher['auth']['ssh_user']}"
    for section in ("head_setup_commands", "worker_setup_commands"):
        downloads = [c for c in launcher[section] if "hf download" in c]
        assert downloads, f"{section} downloads nothing"
        local_dirs = {shlex.split(c)[shlex.split(c).index("--local-dir") + 1] for c in downloads}
        assert {d.replace("~", home, 1) for d in local_dirs} == {config.model.path}


@pytest.mark.parametrize("path", LAUNCHER_CONFIGS, ids=lambda p: p.name)
def test_every_ray_start_uses_token_auth_with_the_shared_token(path):
    launcher = _load(path)
    assert launcher["file_mounts"]["~/.ray/auth_token"] == "~/.ray/auth_token"
    starts = [c for c in launcher["head_start_ray_commands"] + launcher["worker_start_ray_commands"]
              if "ray start" in c or "tandem serve" in c]
    assert len(starts) == 3
    assert all("RAY_AUTH_MODE=token" in c for c in starts)
    assert all("RAY_worker_niceness=0" in c for c in starts if "ray start" in c)  # workers not starved


@pytest.mark.parametrize("path", sorted((REPO / "configs").glob("cluster-*.yaml")), ids=lambda p: p.name)
def test_start_commands_run_the_venvs_ray_and_tandem(path):
    """Not whatever `ray` comes first on PATH: a pyenv or conda init in ~/.bashrc can put the machine's
    python ahead of the venv, and a Ray started by it runs workers that cannot import tandem."""
    launcher = _load(path)
    commands = " ".join(launcher["head_start_ray_commands"] + launcher["worker_start_ray_commands"])
    rays = re.findall(r"(\S+(?: -m ray\.scripts\.scripts)?) (?:start --|stop\b)", commands)
    assert len(rays) == 4, rays
    assert set(rays) <= {"~/venv/bin/ray", "~/venv/bin/python -m ray.scripts.scripts"}, rays
    assert re.findall(r"(\S+) serve --", commands) == ["~/venv/bin/tandem"]


@pytest.mark.parametrize("path", LAUNCHER_CONFIGS, ids=lambda p: p.name)
def test_setup_pins_torch_exactly(path):
    installs = [c for c in _load(path)["setup_commands"] if "pip install" in c]
    assert any('"torch==2.13.0"' in c and "-e ~/tandem" in c for c in installs)
