"""The README and docs stand on their own: every relative link resolves inside the repository."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_docs_point_only_at_files_in_the_repository(page):
    text = page.read_text()
    assert "DESIGN.md" not in text and "../shared" not in text, page
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
        if "://" in target or target.startswith("mailto:"):
            continue
        resolved = (page.parent / target).resolve()
        assert resolved.exists(), f"{page.name} links to {target}, which does not exist"
        assert ROOT in resolved.parents or resolved == ROOT, f"{page.name} links outside: {target}"
