"""The embedpipe command: import/export/info end to end, and one-line errors on bad input."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from embedpipe.cli import main


def run(*args: str) -> subprocess.CompletedProcess:
    """The real command in a new process, as a user runs it."""
    return subprocess.run(
        [sys.executable, "-m", "embedpipe", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_import_info_export_round_trip(tmp_path, bert_folder):
    folder, word_embeddings = bert_folder
    result = run("import", folder, tmp_path / "t.zarr")
    assert result.returncode == 0, result.stderr
    assert "bert.embeddings.word_embeddings.weight [1000, 32] float32" in result.stdout
    assert "import" in result.stderr  # the progress bar goes to stderr

    result = run("info", tmp_path / "t.zarr", "--json")
    info = json.loads(result.stdout)
    assert info["shape"] == [1000, 32] and info["dtype"] == "float32" and info["step"] == 0
    assert info["bytes_on_disk"] >= 1000 * 32 * 4 and info["optimizer"] == "none"

    assert run("export", tmp_path / "t.zarr", tmp_path / "w.safetensors").returncode == 0
    assert torch.equal(load_file(tmp_path / "w.safetensors")["weight"], word_embeddings)


def test_info_text(table, capsys):
    table.add_state("sum")
    assert main(["info", table.path]) == 0
    out = capsys.readouterr().out
    assert (
        "shape           [1000, 16]" in out
        and "64 rows x 16" in out
        and "state           sum" in out
    )


def test_demo_runs(capsys):
    assert main(["demo", "--rows", "500", "--dim", "8"]) == 0
    assert "created a 500 x 8 table" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("make", "args", "message"),
    [
        (None, ["info", "{tmp}/missing.zarr"], "no table at"),
        (None, ["import", "{tmp}/missing.npy", "{tmp}/t.zarr"], "missing.npy does not exist"),
        ("csv", ["import", "{tmp}/w.csv", "{tmp}/t.zarr"], "unknown file type '.csv'"),
        (
            "npy",
            ["import", "{tmp}/w.npy", "{tmp}/t.zarr", "--key", "x"],
            "holds one unnamed array; drop --key x",
        ),
        ("npy", ["export", "{tmp}/w.npy", "{tmp}/o.npy"], "is a file, not a table folder"),
        ("table", ["import", "{tmp}/w.npy", "{tmp}/t.zarr"], "already exists"),
        ("table", ["export", "{tmp}/t.zarr", "{tmp}/o.txt"], "not '.txt'"),
        (
            "table",
            ["import", "{tmp}/w.npy", "{tmp}/u.zarr", "--chunk-rows", "0"],
            "chunk_rows must be a positive integer, got 0",
        ),
    ],
)
def test_bad_input_exits_nonzero_with_one_line(tmp_path, make, args, message):
    if make == "csv":
        (tmp_path / "w.csv").write_text("1,2")
    if make in ("npy", "table"):
        np.save(tmp_path / "w.npy", np.zeros((4, 2), np.float32))
    if make == "table":
        assert run("import", tmp_path / "w.npy", tmp_path / "t.zarr").returncode == 0
    result = run(*[a.format(tmp=tmp_path) for a in args])
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    errors = [line for line in lines if line.startswith("embedpipe: error:")]
    assert len(errors) == 1 and "Traceback" not in result.stderr, result.stderr
    assert message in errors[0]
    assert result.stdout == ""


def test_usage_errors_exit_2():
    assert run("import").returncode == 2
    assert run("frobnicate").returncode == 2
