"""mkdocs hook: links from a page to the repository's files (written as in the README, from the checkout's
root: `results/chaos/`, `tests/test_readme.py`) are checked and rewritten, so a renamed file fails the
strict build as a broken page link does.

A link that names a page of the site (relative to the page) is left to mkdocs. One that names an existing
file or folder of the checkout becomes a link into the repository's browser when `repo_url` is set, and
plain text (its label) when it is not; one that names neither is an error."""

from __future__ import annotations

import re
from pathlib import Path

from mkdocs.exceptions import PluginError

LINK = re.compile(r"(?<!!)\[([^\]]+)\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)


def _rewrite(markdown: str, page_dir: Path, docs_dir: Path, repo: Path, repo_url: str | None, src: str) -> str:
    def one(m: re.Match) -> str:
        label, target = m.group(1), m.group(2)
        if re.match(r"[a-z]+:|#|/", target):
            return m.group(0)
        path = target.split("#")[0]
        if (page_dir / path).resolve().is_relative_to(docs_dir) and (page_dir / path).exists():
            return m.group(0)  # a page or asset of the site: mkdocs checks it
        if not (repo / path).exists():
            raise PluginError(f"{src}: link to {target!r}: no such page and no such file in the repository")
        if repo_url:
            return f"[{label}]({repo_url.rstrip('/')}/tree/main/{target})"
        return label

    parts, last = [], 0
    for fence in FENCE.finditer(markdown):  # links inside code blocks are code, not links
        parts += [LINK.sub(one, markdown[last:fence.start()]), fence.group(0)]
        last = fence.end()
    return "".join(parts) + LINK.sub(one, markdown[last:])


def on_page_markdown(markdown, page, config, files):
    docs_dir = Path(config["docs_dir"]).resolve()
    page_dir = (docs_dir / page.file.src_path).parent
    return _rewrite(markdown, page_dir, docs_dir, docs_dir.parent, config.get("repo_url"), page.file.src_path)
