"""The README's first command runs ``scripts/train_bert.py``: run it as a user would, in a
process of its own, small (``--quick``), with the comparison against ``nn.Embedding``."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "train_bert.py"


def test_the_readme_demo_trains_and_matches_nn_embedding_bit_for_bit(tmp_path):
    table = tmp_path / "vocab.zarr"
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--baseline", "--table", str(table)],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "trained tables bitwise equal" in done.stdout, done.stdout[-2000:]
    assert "accelerator memory the table no longer uses" in done.stdout
    assert table.exists()  # --table keeps it
