"""The docs site (docs/, mkdocs.yml): its reference pages are the code's (regenerated here and compared with
the committed ones), the site builds with `mkdocs build --strict` (a broken link, a page missing from the
nav or a link to a repository file that is gone fails it), and the README stays a short front page whose
links all land."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "docs"))
import gen_reference  # noqa: E402  (docs/ is no package: the generator is not part of the product)


@pytest.mark.parametrize("page", sorted(gen_reference.PAGES))
def test_each_reference_page_is_what_the_code_generates(page, tmp_path):
    gen_reference.write(tmp_path)
    committed = REPO / "docs" / "reference" / page
    assert committed.read_text() == (tmp_path / page).read_text(), (
        f"docs/reference/{page} and the code disagree: run `python docs/gen_reference.py` and commit the page")


def test_the_metrics_page_names_every_metric_the_ingress_registers():
    """The page is read from the source; the registry the server serves must not hold one it missed."""
    from cluster.frontend.http.metrics import IngressMetrics

    listed = {row[0] for row in gen_reference.metric_rows()}
    exported = set()
    for family in IngressMetrics(tenant_labels=True).registry.collect():
        exported.add(f"{family.name}_total" if family.type == "counter" else family.name)
    assert exported and exported <= listed, f"registered but not on the page: {sorted(exported - listed)}"


def test_every_config_key_is_on_the_configuration_page():
    from tests.test_documented_defaults import DEFAULTS

    page = (REPO / "docs" / "reference" / "configuration.md").read_text()
    assert DEFAULTS and all(f"| `{key}` |" in page for key in DEFAULTS), \
        sorted(k for k in DEFAULTS if f"| `{k}` |" not in page)


def test_the_site_builds_strict(tmp_path):
    pytest.importorskip("mkdocs", reason="mkdocs is in the dev extra: pip install -e '.[dev]'")
    pytest.importorskip("material", reason="mkdocs-material is in the dev extra: pip install -e '.[dev]'")
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                          cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert done.returncode == 0, done.stdout + done.stderr
    assert (tmp_path / "site" / "reference" / "configuration" / "index.html").is_file()


def test_the_readme_is_a_short_front_page_whose_links_land():
    readme = (REPO / "README.md").read_text()
    assert len(readme.splitlines()) < 150
    links = re.findall(r"\]\(([^)#\s]+)", readme)
    assert any(link.startswith("docs/") for link in links)
    assert [link for link in links if "://" not in link and not (REPO / link).exists()] == []

