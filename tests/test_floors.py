"""The floors of DESIGN.md: imports only point down, at module level and inside functions alike.

    tandem/ (the command line) -> experiments/ -> cluster/ -> actors/ -> kv_transfer/

A product module (cluster/, actors/, kv_transfer/) that imported a measuring tool or the command line
would make `tandem serve` need the tools' packages, which is how a newcomer's first command broke.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
FLOORS = ["tandem", "experiments", "cluster", "actors", "kv_transfer"]  # top first


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, top-level package) of every absolute import in the file."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name.partition(".")[0]) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.lineno, node.module.partition(".")[0]))
    return found


def upward_imports(floor: str) -> list[str]:
    level = FLOORS.index(floor)
    return [f"{path.relative_to(REPO)}:{line} imports {package}"
            for path in sorted((REPO / floor).rglob("*.py"))
            for line, package in _imports(path)
            if package in FLOORS and FLOORS.index(package) < level]


@pytest.mark.parametrize("floor", FLOORS)
def test_imports_point_down(floor):
    assert upward_imports(floor) == []


def test_the_check_sees_an_upward_import(tmp_path):
    """The walk finds an import inside a function, where a lazy one would hide."""
    module = tmp_path / "m.py"
    module.write_text("def f():\n    from experiments.smoke import shrink\n")
    assert _imports(module) == [(2, "experiments")]


# Inside cluster/control/, folders by responsibility, top first; the modules at its top (config) below them all.
CONTROL_FLOORS = ["autoscale", "lifecycle", "scheduler", ""]


def _control_floor(dotted: str) -> str | None:
    """The control floor a module `cluster.control.<...>` sits on; None outside cluster/control/."""
    parts = dotted.split(".")
    if parts[:2] != ["cluster", "control"] or len(parts) < 3:
        return None
    return parts[2] if parts[2] in CONTROL_FLOORS else ""


def control_upward_imports() -> list[str]:
    found = []
    for path in sorted((REPO / "cluster" / "control").rglob("*.py")):
        here = _control_floor(".".join(path.relative_to(REPO).with_suffix("").parts))
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                there = _control_floor(node.module)
                if there is not None and CONTROL_FLOORS.index(there) < CONTROL_FLOORS.index(here):
                    found.append(f"{path.relative_to(REPO)}:{node.lineno} imports {node.module}")
    return found


def test_control_folders_import_only_downward():
    """The autoscaler resizes through the lifecycle, which starts the scheduler; the scheduler never reaches
    up into either (the loads it reports are its own types), and config sits below all three."""
    assert control_upward_imports() == []
    assert _control_floor("cluster.control.config") == "" and _control_floor("cluster.control.scheduler.actor") == "scheduler"


def control_imports_of_frontend() -> list[str]:
    return [f"{path.relative_to(REPO)}:{node.lineno} imports {node.module}"
            for path in sorted((REPO / "cluster" / "control").rglob("*.py"))
            for node in ast.walk(ast.parse(path.read_text(), str(path)))
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("cluster.frontend")]


def test_control_never_imports_the_frontend():
    """The frontend (client, ingress, admin routes) stands on the control plane; a client is opened on a
    cluster by the frontend (`open_client`), so no folder-level circle joins them."""
    assert control_imports_of_frontend() == []
