"""The layers of docs/architecture.md hold: no module imports a layer above its own, no two
modules of a package (nor two packages) import each other in a circle, no module is over 500
lines. The contracts live in pyproject.toml and are checked by import-linter (``lint-imports``,
which .ci/run also runs)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LINT = shutil.which("lint-imports", path=os.path.dirname(sys.executable)) or shutil.which(
    "lint-imports"
)
needs_linter = pytest.mark.skipif(LINT is None, reason="import-linter is not installed")


def lint(root: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(root)}
    return subprocess.run(
        [LINT, "--no-cache"], cwd=root, env=env, capture_output=True, text=True, timeout=120
    )


@needs_linter
def test_the_layers_and_no_circles_hold():
    done = lint(ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "2 kept, 0 broken" in done.stdout


@needs_linter
def test_an_upward_import_breaks_the_contract(tmp_path):
    """The check can fail: the table's writer lock importing the pipe (a deliberate upward
    import, in a copy of the package) is named, with its line."""
    shutil.copytree(ROOT / "embedpipe", tmp_path / "embedpipe")
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    with open(tmp_path / "embedpipe" / "store" / "lock.py", "a") as f:
        f.write("\nfrom ..pipe import handle  # deliberate: the store reaching up\n")
    done = lint(tmp_path)
    assert done.returncode != 0
    assert "embedpipe.store.lock -> embedpipe.pipe.handle" in done.stdout, done.stdout


def test_no_module_is_over_500_lines():
    long = {
        str(p.relative_to(ROOT)): n
        for p in (ROOT / "embedpipe").rglob("*.py")
        if (n := len(p.read_text().splitlines())) > 500
    }
    assert not long, long
