"""Why a test may skip on CI: the allow-list, and the pytest plugin that holds CI to it (tests/conftest.py
loads it). `.ci/run` sets TANDEM_STRICT_SKIPS=1, and then a test that skips for any reason not starting
with one of these prefixes fails instead, naming the reason: a missing tool, a busy port or a timeout
must not turn a test into a silent skip on the machine that proves the suite. Elsewhere skips stay
skips, and `pytest -rs` (the default, pyproject.toml) prints every reason.

A test skips for an allowed reason with `pytest.skip(needs(KIND, "what exactly"))`."""

from __future__ import annotations

import os

import pytest

ALLOWED = {
    "gpu": "needs a CUDA GPU",
    "cloud": "needs a cloud account",
    "kubernetes": "needs a Kubernetes cluster",
    "vllm": "needs vLLM's own virtualenv",
    "elsewhere": "runs elsewhere",  # the same command is run by CI itself or by another test, named in the reason
}


def needs(kind: str, detail: str) -> str:
    """A skip reason on the allow-list: `needs("gpu", "torch.cuda.is_available() is False")`."""
    return f"{ALLOWED[kind]}: {detail}"


def allowed(reason: str) -> bool:
    """Whether a skip's reason (as pytest reports it, with or without its `Skipped: ` prefix) is allowed."""
    return reason.removeprefix("Skipped: ").startswith(tuple(f"{prefix}: " for prefix in ALLOWED.values()))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    if report.skipped and not hasattr(report, "wasxfail") and os.environ.get("TANDEM_STRICT_SKIPS") == "1":
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        if not allowed(reason):
            report.outcome = "failed"
            report.longrepr = (f"skipped on CI (TANDEM_STRICT_SKIPS=1) for a reason off the allow-list of "
                               f"tests/helpers/skips.py ({'; '.join(ALLOWED.values())}): {reason}")
    return report
