"""Finding (or installing) helm and rendering the chart, for the chart tests."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "helm" / "tandem"
INSTALLER = REPO / ".ci" / "install-helm"


def find_helm() -> str | None:
    """$TANDEM_HELM, else the copy .ci/install-helm caches, else helm on PATH."""
    explicit = os.environ.get("TANDEM_HELM")
    if explicit:
        if not os.access(explicit, os.X_OK):
            raise RuntimeError(f"TANDEM_HELM={explicit} is not an executable")
        return explicit
    cached = REPO / ".cache" / "helm" / "helm"
    if os.access(cached, os.X_OK):
        return str(cached)
    return shutil.which("helm")


def ensure_helm() -> str:
    """A helm binary; runs .ci/install-helm when there is none, so a fresh checkout tests the chart too."""
    helm = find_helm()
    if helm:
        return helm
    if shutil.which("npm") is None:
        raise RuntimeError("no helm found and no npm to fetch it: run .ci/install-helm on a machine with npm, "
                           "or point TANDEM_HELM at a helm v3 binary")
    done = subprocess.run([str(INSTALLER)], capture_output=True, text=True, timeout=600)
    helm = find_helm()
    if done.returncode != 0 or helm is None:
        raise RuntimeError(f".ci/install-helm failed (exit {done.returncode}); run it by hand to see why:\n{done.stderr}")
    return helm


def run_helm(helm: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([helm, *args], capture_output=True, text=True, timeout=120)


def render(helm: str, values: Path | None, *extra: str) -> list[dict]:
    """`helm template` of the chart as a list of objects; raises with helm's message on failure."""
    args = ["template", "tandem-test", str(CHART), "--namespace", "serving", *extra]
    if values is not None:
        args += ["--values", str(values)]
    done = run_helm(helm, *args)
    if done.returncode != 0:
        raise RuntimeError(done.stderr.strip())
    return [doc for doc in yaml.safe_load_all(done.stdout) if doc]
