"""The embedpipe command: import/export/info end to end, and one-line errors on bad input."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import zarr
from safetensors.torch import load_file, save_file

import embedpipe
from embedpipe.tools.cli import main

from ..helpers import run_cli


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
    result = run("import", folder, tmp_path / "t.zarr")  # a real process, as a user runs it
    assert result.returncode == 0, result.stderr
    assert "bert.embeddings.word_embeddings.weight [1000, 32] float32" in result.stdout
    assert "import" in result.stderr  # the progress bar goes to stderr

    result = run_cli("info", tmp_path / "t.zarr", "--json")
    info = json.loads(result.stdout)
    assert info["shape"] == [1000, 32] and info["dtype"] == "float32" and info["step"] == 0
    assert info["bytes_on_disk"] >= 1000 * 32 * 4 and info["optimizer"] == "none"

    assert run_cli("export", tmp_path / "t.zarr", tmp_path / "w.safetensors").returncode == 0
    assert torch.equal(load_file(tmp_path / "w.safetensors")["weight"], word_embeddings)


def test_info_text(table, capsys):
    table.add_state("sum")
    table.checkpoint()  # info shows the last checkpoint
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
        ("big", ["import", "{tmp}/big.npy", "{tmp}/t.zarr", "--dtype", "float16"], "beyond"),
        (None, ["demo", "--rows", "3", "--dim", "100000000000000"], "Unable to allocate"),
        (None, ["bench", "--dir", "{tmp}/missing"], "missing: no such folder; make it first"),
    ],
)
def test_bad_input_exits_nonzero_with_one_line(tmp_path, make, args, message):
    if make == "csv":
        (tmp_path / "w.csv").write_text("1,2")
    if make == "big":  # past float16's 65504
        np.save(tmp_path / "big.npy", np.full((4, 2), 1e5, np.float32))
    if make in ("npy", "table"):
        np.save(tmp_path / "w.npy", np.zeros((4, 2), np.float32))
    if make == "table":
        assert run_cli("import", tmp_path / "w.npy", tmp_path / "t.zarr").returncode == 0
    result = run_cli(*[a.format(tmp=tmp_path) for a in args])
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    errors = [line for line in lines if line.startswith("embedpipe: error:")]
    assert len(errors) == 1 and "Traceback" not in result.stderr, result.stderr
    assert message in errors[0]
    assert result.stdout == ""


def test_usage_errors_exit_2():
    assert run_cli("import").returncode == 2
    assert run_cli("frobnicate").returncode == 2


# ------------------------------------------------------------------------------ bad input
# Every bad input ends as one line on stderr, `embedpipe: error: ...`, that names the path typed
# and says what to do: no traceback, no terminal colour codes, no temporary file names, none of
# torch's, numpy's or zarr's internal wording.
def _bad_files(tmp: Path) -> None:
    """Every kind of bad input the tests below point the command at, made in ``tmp``."""
    rng = np.random.default_rng(0)
    (tmp / "random.pt").write_bytes(rng.integers(0, 256, 2000, dtype=np.uint8).tobytes())
    torch.save({"w": torch.randn(50, 4)}, tmp / "real.pt")
    data = (tmp / "real.pt").read_bytes()
    (tmp / "truncated.pt").write_bytes(data[: len(data) // 2])
    torch.save(torch.randn(50, 4), tmp / "legacy.pt", _use_new_zipfile_serialization=False)
    data = (tmp / "legacy.pt").read_bytes()
    (tmp / "truncated_legacy.pt").write_bytes(data[: len(data) // 2])
    torch.save(torch.nn.Linear(2, 2), tmp / "module.pt")
    torch.save([torch.zeros(2, 2)], tmp / "list.pt")
    torch.save({"a": torch.zeros(3, 2), "b": torch.zeros(3, 2)}, tmp / "two.pt")
    (tmp / "text.npy").write_text("1,2,3\n4,5,6\n")
    np.savez(tmp / "archive.npz", a=np.zeros(3))
    (tmp / "archive.npz").rename(tmp / "archive.npy")
    np.save(tmp / "objects.npy", np.array([{"a": 1}], dtype=object), allow_pickle=True)
    np.save(tmp / "w.npy", np.zeros((4, 2), np.float32))
    save_file({k: torch.zeros(3, 2) for k in "abc"}, tmp / "three.safetensors")
    save_file({f"t{i:02}": torch.zeros(3, 2) for i in range(14)}, tmp / "many.safetensors")
    (tmp / "garbage.safetensors").write_bytes(b"\xff" * 100)
    (tmp / "notjson.safetensors").write_bytes(b"\x10" + b"\0" * 7 + b"this is not json")
    (tmp / "empty").mkdir()
    (tmp / "no_weights").mkdir()
    (tmp / "no_weights" / "config.json").write_text("{}")
    (tmp / "bad_index").mkdir()
    (tmp / "bad_index" / "model.safetensors.index.json").write_text("{")
    (tmp / "folder.npy").mkdir()
    zarr.open_group(tmp / "group.zarr", mode="w")
    zarr.create_array(tmp / "array.zarr", shape=(3,), dtype="float32")
    torch.save({"w": torch.ones(10, 4).to_sparse()}, tmp / "sparse.pt")
    torch.save({"w": torch.ones(10, 4, dtype=torch.int32)}, tmp / "ints.pt")
    np.save(tmp / "ids.npy", np.arange(32).reshape(4, 8))
    embedpipe.import_table(tmp / "w.npy", tmp / "t.zarr").close()


def _one_line_error(capsys, args: list[str], path: str) -> str:
    """Run the command; check it failed with one clean line naming ``path``; return the line."""
    code = main(args)
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert code == 1, captured.err
    assert len(lines) == 1, captured.err
    line = lines[0]
    assert line.startswith("embedpipe: error: "), line
    assert path in line, line
    for leak in ("Traceback", "\x1b[", ".tmp", "(101)", "Errno", "allow_pickle", "weights_only"):
        assert leak not in line, line
    assert captured.out == ""
    return line


@pytest.mark.parametrize(
    ("args", "named", "expected"),
    [
        # 1. a corrupt .pt: a short reason, none of torch's internals
        (["import", "random.pt", "x.zarr"], "random.pt", ["not a readable PyTorch file ("]),
        (["import", "truncated.pt", "x.zarr"], "truncated.pt", ["not a readable PyTorch file ("]),
        (
            ["import", "truncated_legacy.pt", "x.zarr"],
            "truncated_legacy.pt",
            ["not a readable PyTorch file (", "ends early: truncated?"],
        ),
        # 2. a pickled module: what it holds and how to save a state dict instead
        (
            ["import", "module.pt", "x.zarr"],
            "module.pt",
            ["pickled torch.nn.modules.linear.Linear object", "torch.save(model.state_dict()"],
        ),
        (["import", "list.pt", "x.zarr"], "list.pt", ["holds no tensors", "state_dict()"]),
        # 3. not a .npy file, whatever numpy thinks it might be
        (["import", "text.npy", "x.zarr"], "text.npy", ["text.npy: not a .npy array file"]),
        (["import", "archive.npy", "x.zarr"], "archive.npy", ["not a .npy array file"]),
        (["import", "objects.npy", "x.zarr"], "objects.npy", ["Python objects", "numpy.save"]),
        # 4. export into a folder that does not exist: the destination, not the temporary file
        (
            ["export", "t.zarr", "missing/folder/out.npy"],
            "missing/folder/out.npy",
            ["the folder", "missing/folder does not exist"],
        ),
        (
            ["export", "t.zarr", "missing/folder/out.safetensors"],
            "missing/folder/out.safetensors",
            ["the folder", "missing/folder does not exist"],
        ),
        (
            ["export", "t.zarr", "w.npy/out.npy"],
            "w.npy/out.npy",
            ["the folder", "is a file, not a folder"],
        ),
        (["export", "t.zarr", "folder.npy", "--force"], "folder.npy", ["is a folder"]),
        # 5. an unknown --key lists the tensors there are (ten, then a count)
        (
            ["import", "three.safetensors", "x.zarr", "--key", "nope"],
            "three.safetensors",
            ["no tensor named 'nope'", "from: a, b, c"],
        ),
        (
            ["import", "many.safetensors", "x.zarr", "--key", "nope"],
            "many.safetensors",
            ["t00, t01, t02, t03, t04, t05, t06, t07, t08, t09 and 4 more"],
        ),
        (
            ["import", "two.pt", "x.zarr", "--key", "nope"],
            "two.pt",
            ["no tensor named 'nope'", "from: a, b"],
        ),
        # 6. Python argument names come with the command-line option
        (
            ["export", "t.zarr", "w.npy"],
            "w.npy",
            ["already exists", "overwrite=True (--force on the command line)"],
        ),
        (
            ["import", "w.npy", "empty", "--force"],
            "empty",
            ["is not an embedpipe table", "(--force on the command line)", "pick another"],
        ),
        (
            ["import", "w.npy", "x.zarr", "--chunk-rows", "0"],
            "",  # the value is named, no path
            ["chunk_rows must be a positive integer, got 0 (--chunk-rows on the command line)"],
        ),
        # 7. a folder that is not a table
        (
            ["info", "empty"],
            "empty",
            ["is not an embedpipe table (no zarr.json", "make one with `embedpipe import`"],
        ),
        (
            ["export", "empty", "o.npy"],
            "empty",
            ["is not an embedpipe table (no zarr.json", "make one with `embedpipe import`"],
        ),
        (["info", "array.zarr"], "array.zarr", ["make", "`embedpipe import`"]),
        (["info", "group.zarr"], "group.zarr", ["make", "`embedpipe import`"]),
        # and the rest
        (["import", "missing.pt", "x.zarr"], "missing.pt", ["does not exist", "give a"]),
        (["import", "no_weights", "x.zarr"], "no_weights", ["no model.safetensors", "point at"]),
        (
            ["import", "bad_index", "x.zarr"],
            "bad_index/model.safetensors.index.json",
            ["not a readable checkpoint index"],
        ),
        (
            ["import", "garbage.safetensors", "x.zarr"],
            "garbage.safetensors",
            ["not a readable safetensors file (", "again"],
        ),
        (
            ["import", "notjson.safetensors", "x.zarr"],
            "notjson.safetensors",
            ["not a readable safetensors file (", "again"],
        ),
        (
            ["import", "w.npy", "t.zarr"],
            "t.zarr",
            ["already exists", "overwrite=True (--force on the command line)"],
        ),
        (
            ["import", "w.npy", "w.npy/x.zarr"],
            "w.npy/x.zarr",
            ["w.npy is a file", "pick another destination"],
        ),
        (["info", "nothing.zarr"], "nothing.zarr", ["no table at", "`embedpipe import`"]),
        (["convert", "t.zarr", "ids.npy", "w.npy/o.zarr"], "w.npy/o.zarr", ["is a file"]),
        (["convert", "t.zarr", "ids.npy", "t.zarr/o.zarr"], "t.zarr/o.zarr", ["inside the table"]),
        (
            ["convert", "t.zarr", "ids.npy", "o.zarr", "--full-embedding-block", "nowhere"],
            "nowhere",
            ["no such folder"],
        ),
        (["import", "sparse.pt", "x.zarr", "--key", "w"], "sparse.pt", ["not dense"]),
        (["import", "ints.pt", "x.zarr", "--key", "w"], "ints.pt", ["not floating point"]),
        (
            ["advise", "--num-rows", "100", "--dim", "4", "--trace", "ids.npy", "--sizes", "inf%"],
            "inf%",
            ["cannot read"],
        ),
        (
            [
                "advise",
                "--num-rows",
                "100",
                "--dim",
                "4",
                "--trace",
                "w.npy",
                "--json",
                "no/a.json",
            ],
            "no/a.json",
            ["does not exist"],
        ),
    ],
    ids=[
        "corrupt-pt-random-bytes",
        "corrupt-pt-truncated-zip",
        "corrupt-pt-truncated-legacy",
        "pt-pickled-module",
        "pt-list-without-tensors",
        "npy-text-file",
        "npy-npz-archive",
        "npy-object-array",
        "export-missing-folder-npy",
        "export-missing-folder-safetensors",
        "export-folder-is-a-file",
        "export-onto-a-folder",
        "key-not-found-safetensors",
        "key-not-found-many",
        "key-not-found-pt",
        "export-exists-names-force",
        "import-force-onto-non-table",
        "chunk-rows-zero",
        "info-empty-folder",
        "export-from-empty-folder",
        "info-zarr-array",
        "info-zarr-group",
        "import-missing-source",
        "import-folder-without-weights",
        "import-bad-shard-index",
        "safetensors-garbage",
        "safetensors-header-not-json",
        "import-onto-existing-table",
        "import-under-a-file",
        "info-missing-path",
        "convert-under-a-file",
        "convert-inside-the-table",
        "convert-block-not-a-folder",
        "import-sparse-tensor",
        "import-int-tensor",
        "advise-infinite-size",
        "advise-json-in-no-folder",
    ],
)
def test_bad_input_is_one_line_naming_the_path(
    tmp_path, capsys, monkeypatch, args, named, expected
):
    _bad_files(tmp_path)
    before = sorted(p.name for p in tmp_path.rglob("*"))
    monkeypatch.chdir(tmp_path)  # the paths are typed as a user types them, relative
    line = _one_line_error(capsys, args, named)
    for text in expected:
        assert text in line, line
    assert sorted(p.name for p in tmp_path.rglob("*")) == before  # nothing was written


def test_force_onto_a_table_being_written_says_so(table, tmp_path, capsys):
    np.save(tmp_path / "w.npy", np.zeros((4, 2), np.float32))
    line = _one_line_error(
        capsys, ["import", str(tmp_path / "w.npy"), table.path, "--force"], table.path
    )
    assert "open for writing" in line and "(--force on the command line)" in line
    assert "mode=" not in line and "close()" not in line
    assert table.num_rows == 1000 and table.read([0]).shape == (1, 16)  # untouched


def test_demo_sizes_must_be_positive(capsys):
    for args in (["demo", "--rows", "0"], ["demo", "--dim", "-3"], ["demo", "--rows", "x"]):
        with pytest.raises(SystemExit) as e:
            main(args)
        assert e.value.code == 2
        assert "must be a positive integer" in capsys.readouterr().err


# ----------------------------------------------------------------------------- checkpoints
def _trained(tmp_path):
    """A table trained for 4 steps with a checkpoint after each, keeping 3."""
    path = tmp_path / "t.zarr"
    embedpipe.Table.from_tensor(path, np.zeros((10, 4), np.float32)).close()
    data = [{"input_ids": torch.tensor([i % 10])} for i in range(4)]
    with embedpipe.EmbeddingPipe(
        path, cache_rows=5, optimizer=embedpipe.optim.SGD(lr=1.0), keep=3
    ) as pipe:
        for batch in pipe.loader(data, batch_size=1):
            (-batch["inputs_embeds"]).sum().backward()
            pipe.step()
            pipe.checkpoint()
    return path


def test_info_lists_the_checkpoints_and_describes_an_older_one(tmp_path, capsys):
    path = _trained(tmp_path)
    assert main(["info", str(path)]) == 0
    out = capsys.readouterr().out
    assert "step            4" in out and "keep            3" in out
    assert out.count("step 2 (") == 1 and "step 4 (" in out and "step 1 (" not in out
    assert main(["info", str(path), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert [c["step"] for c in info["checkpoints"]] == [2, 3, 4]
    assert main(["info", str(path), "--step", "3"]) == 0
    assert "step            3" in capsys.readouterr().out


def test_export_of_an_older_step(tmp_path, capsys):
    path = _trained(tmp_path)
    assert main(["export", str(path), str(tmp_path / "s2.npy"), "--step", "2"]) == 0
    assert "at step 2" in capsys.readouterr().out
    assert np.load(tmp_path / "s2.npy")[0:2].tolist() == [[1.0] * 4, [1.0] * 4]  # ids 0 and 1
    assert np.load(tmp_path / "s2.npy")[2].tolist() == [0.0] * 4  # id 2 is step 3's
    assert main(["export", str(path), str(tmp_path / "s1.npy"), "--step", "1"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "no checkpoint at step 1; it has steps [2, 3, 4]" in err


def test_export_into_the_tables_own_folder_is_refused(tmp_path, capsys):
    path = _trained(tmp_path)
    assert main(["export", str(path), str(path / "out.npy")]) == 1
    assert "inside the table" in capsys.readouterr().err
    assert not (path / "out.npy").exists()


def test_a_table_whose_making_did_not_finish_says_so(tmp_path, capsys):
    path = _trained(tmp_path)
    shutil.rmtree(path / "checkpoints")  # as if killed before the first commit
    assert main(["info", str(path)]) == 1
    err = capsys.readouterr().err
    assert "making the table did not finish" in err and str(path) in err


def test_info_and_export_of_a_damaged_table_name_the_chunk(tmp_path, capsys):
    embedpipe.Table.create(tmp_path / "t.zarr", 100, 4, chunk_rows=16).close()
    chunk = tmp_path / "t.zarr" / "weight" / "c" / "2" / "0"
    chunk.write_bytes(chunk.read_bytes()[:100])  # truncated
    for argv in (
        ["info", str(tmp_path / "t.zarr")],
        ["export", str(tmp_path / "t.zarr"), str(tmp_path / "o.npy")],
    ):
        assert main(argv) == 1
        err = capsys.readouterr().err
        said = [line for line in err.splitlines() if line.startswith("embedpipe:")]
        assert len(said) == 1 and "chunk 2 (rows 32..47)" in said[0], err
        assert "has 100 bytes" in said[0]
