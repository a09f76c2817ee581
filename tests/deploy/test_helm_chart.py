"""The Helm chart: lint, render, and validate what it renders, offline.

Core Kubernetes objects (and the RayCluster's pod templates, as Pods) go through kubernetes-validate's
strict schemas; the RayCluster through KubeRay's CRD schema; the rendered pool config through
tandem's own loader. Then the parts must fit each other: the Service reaches the head's HTTP port,
the probes hit /health and /ready, each pool lands in its own worker group.
"""

from __future__ import annotations

import base64
import copy
import json
from pathlib import Path

import kubernetes_validate
import pytest

from cluster.control.config import TandemConfig
from tests.deploy.crd_schema import crd_validator, errors
from tests.deploy.helm import CHART, REPO, ensure_helm, render, run_helm

KUBERNETES_VERSION = "1.33"
CRD = REPO / "tests" / "deploy" / "schemas" / "kuberay-ray.io_rayclusters.yaml"
SHARED_CRD = REPO.parent / "shared" / "schemas" / CRD.name
VALUES = {"default": None, **{p.stem: p for p in sorted((CHART / "ci").glob("*.yaml"))}}
CONFIG_DIR = "/etc/tandem"
KEYS_DIR = "/etc/tandem-keys"


@pytest.fixture(scope="session")
def helm() -> str:
    try:
        return ensure_helm()
    except RuntimeError as exc:  # CI must check the chart: no helm is a failure, never a skip
        pytest.fail(f"{exc}\n(run .ci/install-helm, or set TANDEM_HELM)")


@pytest.fixture(scope="session")
def raycluster_validator():
    if SHARED_CRD.is_file():
        assert SHARED_CRD.read_bytes() == CRD.read_bytes(), f"{CRD} differs from {SHARED_CRD}: copy it again"
    return crd_validator(CRD, "v1")


@pytest.fixture(scope="session", params=sorted(VALUES), ids=str)
def rendered(request, helm) -> dict[str, dict]:
    """kind -> the one object of that kind, for each values file."""
    objects = render(helm, VALUES[request.param])
    kinds = [o["kind"] for o in objects]
    assert len(kinds) == len(set(kinds)), kinds
    return {o["kind"]: o for o in objects}


def _head(raycluster: dict) -> dict:
    return raycluster["spec"]["headGroupSpec"]["template"]


def _pool_config(objects: dict, tmp_path: Path) -> TandemConfig:
    path = tmp_path / "config.yaml"
    path.write_text(objects["ConfigMap"]["data"]["config.yaml"])
    return TandemConfig.from_file(path)


def test_there_are_ci_values_beyond_the_defaults():
    assert set(VALUES) == {"default", "ci-values", "colocated-values"}


@pytest.mark.parametrize("name", sorted(VALUES))
def test_lint(helm, name):
    args = ["lint", "--strict", str(CHART)] + (["--values", str(VALUES[name])] if VALUES[name] else [])
    done = run_helm(helm, *args)
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.parametrize("name, kinds", [
    ("default", ["Secret", "ConfigMap", "Service", "RayCluster"]),
    ("ci-values", ["Secret", "ConfigMap", "Service", "RayCluster", "ServiceMonitor"]),
    ("colocated-values", ["Secret", "ConfigMap", "Service", "RayCluster"]),
])
def test_renders_the_expected_objects(helm, name, kinds):
    assert [o["kind"] for o in render(helm, VALUES[name])] == kinds


def test_core_objects_pass_the_kubernetes_schema(rendered):
    for kind in ("Secret", "ConfigMap", "Service"):
        kubernetes_validate.validate(rendered[kind], KUBERNETES_VERSION, strict=True)


def test_ray_pod_templates_are_valid_pods(rendered):
    spec = rendered["RayCluster"]["spec"]
    templates = [spec["headGroupSpec"]["template"]] + [g["template"] for g in spec["workerGroupSpecs"]]
    for template in templates:
        pod = {"apiVersion": "v1", "kind": "Pod", "metadata": template["metadata"], "spec": template["spec"]}
        kubernetes_validate.validate(pod, KUBERNETES_VERSION, strict=True)


def test_raycluster_passes_the_kuberay_crd_schema(rendered, raycluster_validator):
    assert errors(raycluster_validator, rendered["RayCluster"]) == []


def test_the_crd_check_catches_a_misspelled_field(rendered, raycluster_validator):
    broken = copy.deepcopy(rendered["RayCluster"])
    broken["spec"]["workerGroupSpecs"][0]["template"]["spec"]["nodeselector"] = {"gpu": "yes"}
    assert errors(raycluster_validator, broken) == [
        "spec/workerGroupSpecs/0/template/spec: Additional properties are not allowed ('nodeselector' was unexpected)"
    ]


def test_config_map_holds_a_valid_pool_config_for_the_worker_groups(rendered, tmp_path):
    config = _pool_config(rendered, tmp_path)
    groups = {g["groupName"]: g for g in rendered["RayCluster"]["spec"]["workerGroupSpecs"]}
    assert set(groups) == set(config.pools())
    for role, pool in config.pools().items():
        group = groups[role]
        assert group["replicas"] == pool.replicas
        assert group["minReplicas"] <= pool.replicas <= group["maxReplicas"]
        # KubeRay passes this string to `ray start --resources=` through a shell.
        offered = json.loads(group["rayStartParams"]["resources"].strip("'"))
        assert offered == pool.resources == {f"tandem_{role}": 1}
        (container,) = group["template"]["spec"]["containers"]
        assert container["resources"].get("limits", {}).get("nvidia.com/gpu", 0) == pool.num_gpus


def test_head_runs_tandem_serve_on_the_mounted_config(rendered, tmp_path):
    config = _pool_config(rendered, tmp_path)
    head = _head(rendered["RayCluster"])
    assert head["metadata"]["annotations"]["ray.io/overwrite-container-cmd"] == "true"
    container = head["spec"]["containers"][0]
    script = container["args"][0]
    assert 'eval "$KUBERAY_GEN_RAY_START_CMD" &' in script
    assert (f"tandem serve --address auto --config {CONFIG_DIR}/config.yaml --host 0.0.0.0 "
            f"--port {config.ingress.port}") in script
    (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == CONFIG_DIR]
    (volume,) = [v for v in head["spec"]["volumes"] if v["name"] == mount["name"]]
    assert volume["configMap"]["name"] == rendered["ConfigMap"]["metadata"]["name"]


def test_service_and_probes_reach_the_ingress(rendered, tmp_path):
    config = _pool_config(rendered, tmp_path)
    raycluster, service = rendered["RayCluster"], rendered["Service"]
    container = _head(raycluster)["spec"]["containers"][0]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports["http"] == config.ingress.port
    # KubeRay labels the head pod so; the Service must pick exactly it.
    assert service["spec"]["selector"] == {"ray.io/cluster": raycluster["metadata"]["name"], "ray.io/node-type": "head"}
    (port,) = service["spec"]["ports"]
    assert port["targetPort"] == "http"
    probes = {kind: container[kind]["httpGet"] for kind in ("startupProbe", "livenessProbe", "readinessProbe")}
    assert probes == {"startupProbe": {"path": "/health", "port": "http"},
                      "livenessProbe": {"path": "/health", "port": "http"},
                      "readinessProbe": {"path": "/ready", "port": "http"}}


def test_service_monitor_scrapes_the_service_metrics(helm):
    objects = {o["kind"]: o for o in render(helm, VALUES["ci-values"])}
    monitor, service = objects["ServiceMonitor"], objects["Service"]
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": ["serving"]}
    assert monitor["metadata"]["labels"]["release"] == "prometheus"
    (endpoint,) = monitor["spec"]["endpoints"]
    assert (endpoint["port"], endpoint["path"]) == (service["spec"]["ports"][0]["name"], "/metrics")


def test_ci_values_reach_the_pods(helm):
    objects = {o["kind"]: o for o in render(helm, VALUES["ci-values"])}
    spec = objects["RayCluster"]["spec"]
    head = spec["headGroupSpec"]["template"]["spec"]
    assert head["nodeSelector"] == {"node.kubernetes.io/instance-type": "m5.2xlarge"}
    assert head["tolerations"][0]["value"] == "tandem-head"
    groups = {g["groupName"]: g for g in spec["workerGroupSpecs"]}
    prefill = groups["prefill"]["template"]["spec"]
    assert prefill["nodeSelector"] == {"cloud.google.com/gke-accelerator": "nvidia-l4"}
    assert prefill["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    assert "podAntiAffinity" in prefill["affinity"]
    assert groups["decode"]["template"]["spec"]["nodeSelector"] == {"cloud.google.com/gke-accelerator": "nvidia-h100-80gb"}
    assert spec["enableInTreeAutoscaling"] is True and spec["authOptions"] == {"mode": "token"}
    model_volume = [v for v in head["volumes"] if v["name"] == "model"]
    assert model_volume[0]["persistentVolumeClaim"]["claimName"] == "llama3-8b-weights"
    assert objects["Service"]["spec"]["type"] == "LoadBalancer"


def _keys_mount(objects: dict) -> tuple[dict, dict]:
    head = _head(objects["RayCluster"])
    (mount,) = [m for m in head["spec"]["containers"][0]["volumeMounts"] if m["mountPath"] == KEYS_DIR]
    (volume,) = [v for v in head["spec"]["volumes"] if v["name"] == mount["name"]]
    return mount, volume


def test_keys_live_in_a_secret_the_ingress_reads(helm, tmp_path):
    """No key in the ConfigMap; the generated Secret holds one API key and the admin key, mounted where
    the rendered config points, in the format `tandem serve` reads."""
    objects = {o["kind"]: o for o in render(helm, None)}
    secret, config_text = objects["Secret"], objects["ConfigMap"]["data"]["config.yaml"]
    files = {name: base64.b64decode(value).decode() for name, value in secret["data"].items()}
    assert set(files) == {"api_keys.yaml", "admin-key"}
    for value in files.values():
        assert value.strip() and value.strip().split(":")[0] not in config_text
    mount, volume = _keys_mount(objects)
    assert mount["readOnly"] and volume["secret"]["secretName"] == secret["metadata"]["name"]
    for name, text in files.items():  # as the pod would see them
        (tmp_path / name).write_text(text)
    config = _pool_config(objects, tmp_path)
    assert (config.ingress.api_keys_file, config.ingress.admin_key_file) == (
        f"{KEYS_DIR}/api_keys.yaml", f"{KEYS_DIR}/admin-key")
    local = config.ingress.model_copy(update={"api_keys_file": str(tmp_path / "api_keys.yaml"),
                                              "admin_key_file": str(tmp_path / "admin-key")})
    (tenant,) = local.tenants().values()
    assert tenant.tenant == "default" and len(local.admin()) == 40


def test_given_keys_an_own_secret_or_anonymous_serving(helm, tmp_path):
    given = {o["kind"]: o for o in render(helm, None, "--set", "access.apiKeys.k-1.tenant=team-a",
                                          "--set", "access.adminKey=op-key")}
    files = {n: base64.b64decode(v).decode() for n, v in given["Secret"]["data"].items()}
    assert files["admin-key"] == "op-key" and "k-1:" in files["api_keys.yaml"] and "team-a" in files["api_keys.yaml"]
    own = {o["kind"]: o for o in render(helm, None, "--set", "access.existingSecret=my-keys")}
    assert "Secret" not in own and _keys_mount(own)[1]["secret"]["secretName"] == "my-keys"
    anonymous = {o["kind"]: o for o in render(helm, None, "--set", "access.allowAnonymous=true")}
    assert set(anonymous["Secret"]["data"]) == {"admin-key"}
    config = _pool_config(anonymous, tmp_path)
    assert config.ingress.allow_anonymous and config.ingress.api_keys_file is None


@pytest.mark.parametrize("override, message", [
    (["--set", "config.ingress.api_keys.sk-1.tenant=a"], "keep API and admin keys out of config.ingress"),
    (["--set", "config.ingress.admin_key=x"], "keep API and admin keys out of config.ingress"),
    (["--set", "mode=disagregated"], 'mode must be disaggregated or colocated, not "disagregated"'),
    (["--set", "pools.decode.replicas=9"], "pools.decode.replicas (9) must lie within minReplicas (0) and maxReplicas (4)"),
])
def test_bad_values_fail_to_render_naming_the_key(helm, override, message):
    with pytest.raises(RuntimeError, match=message.replace("(", r"\(").replace(")", r"\)")):
        render(helm, None, *override)
