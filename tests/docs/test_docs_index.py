"""The docs index (docs/README.md) lists every page of docs/, and the README links to it."""

from __future__ import annotations

import re
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[2]
_INDEX = _ROOT / "docs" / "README.md"


def test_the_index_lists_every_page_and_only_pages_that_exist() -> None:
    listed = set(re.findall(r"^\| \[\w+\.md\]\((\w+\.md)\) \|", _INDEX.read_text(), re.M))
    pages = {p.name for p in (_ROOT / "docs").glob("*.md")} - {"README.md"}
    assert listed == pages


def test_the_readme_links_the_index_and_the_contributors_page_holds_ci() -> None:
    readme = (_ROOT / "README.md").read_text()
    assert "](docs/README.md)" in readme
    install = readme[readme.index("## Quick start"):readme.index("## Example")]
    assert ".ci/run" not in install  # CI is for contributors: docs/contributing.md
    assert "CI (`.ci/run`)" in (_ROOT / "docs" / "contributing.md").read_text()
