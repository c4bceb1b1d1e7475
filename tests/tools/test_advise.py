"""``embedpipe advise`` (and ``advice.advise``): the curve, the recommended size, the knee, the
picture, one-line errors; and ``embedpipe bench`` handing its arguments to the benchmark."""

from __future__ import annotations

import importlib.util
import json
import sys

import numpy as np
import pytest

import embedpipe
from embedpipe.cache.budget import pipe_memory
from embedpipe.tools import simulate
from embedpipe.tools.advice import advice_sizes, advise
from embedpipe.tools.simulate import batch_sets, rows_read

from ..helpers import run_cli as run
from .test_simulate import zipf_ids

NUM_ROWS, DIM, BATCH = 1500, 16, 8


@pytest.fixture(scope="module")
def trace(tmp_path_factory) -> tuple[str, np.ndarray]:
    ids = zipf_ids(50 * BATCH, 32, NUM_ROWS, seed=3)
    path = tmp_path_factory.mktemp("trace") / "ids.npy"
    np.save(path, ids)
    return str(path), ids


def test_advise_recommends_the_largest_cache_that_fits_and_finds_the_knee(trace):
    _, ids = trace
    sets = batch_sets(ids, BATCH)
    memory = 900_000  # bytes: index and ring of 2 workers (813 kB), and a few hundred rows
    advice = advise(sets, NUM_ROWS, DIM, "float32", memory, state_arrays=1, workers=2)

    best = advice["recommended"]["cache_rows"]
    cost = dict(state_arrays=1, num_workers=2)
    assert pipe_memory(NUM_ROWS, DIM, "float32", best, **cost)["total"] <= memory
    assert pipe_memory(NUM_ROWS, DIM, "float32", best + 1, **cost)["total"] > memory
    assert advice["recommended"]["memory"] == pipe_memory(NUM_ROWS, DIM, "float32", best, **cost)
    assert advice["recommended"]["rows_read"] == rows_read(sets, NUM_ROWS, best, "auto")
    assert advice["recommended"]["optimum"] == rows_read(sets, NUM_ROWS, best, "belady")

    curve = advice["curve"]
    assert best in curve["cache_rows"] and set(curve["rows_read"]) == set(simulate.POLICIES)
    assert curve["cache_rows"] == sorted({*advice_sizes(NUM_ROWS), best})
    for i, size in enumerate(curve["cache_rows"]):  # the optimum is the least of all
        optimum = curve["rows_read"]["belady"][i]
        assert all(reads[i] >= optimum for reads in curve["rows_read"].values()), size

    knee = advice["knee"]
    limit = 1.05 * advice["recommended"]["rows_read"]
    assert knee["cache_rows"] <= best and knee["rows_read"] <= limit
    smaller = max(0, knee["cache_rows"] - max(1, knee["cache_rows"] // 200) - 1)
    assert rows_read(sets, NUM_ROWS, smaller, "auto") > limit  # the smallest, to 0.5%


def test_advise_refuses_a_budget_below_the_fixed_part(trace):
    sets = batch_sets(trace[1], BATCH)
    with pytest.raises(ValueError, match="cannot hold even what a pipe over 1,500 rows"):
        advise(sets, NUM_ROWS, DIM, "float32", 1000, workers=2)


def test_the_command_prints_the_table_and_writes_json_and_png(trace, tmp_path):
    path, ids = trace
    out_json, out_png = tmp_path / "advice.json", tmp_path / "curve.png"
    result = run(
        "advise", "--trace", path, "--num-rows", NUM_ROWS, "--dim", DIM, "--memory", "0.9MB",
        "--batch-size", BATCH, "--optimizer", "adagrad", "--json", out_json, "--png", out_png,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "simulating" in result.stderr  # the progress bar; results on stdout
    lines = result.stdout.splitlines()
    assert lines[0].startswith(f"50 batches of {BATCH} samples from {path} (at most ")
    advice = json.loads(out_json.read_text())
    best = advice["recommended"]["cache_rows"]
    table = [line for line in lines if line.strip().startswith(f"{best:,} *")]
    assert len(table) == 1  # the recommended row is marked
    assert any(line.startswith(f"recommended (*): cache_rows={best:,} ") for line in lines)
    knee = advice["knee"]["cache_rows"]
    said = [line for line in lines if line.startswith("knee: ")]
    assert len(said) == 1
    if knee < best:  # how much smaller the knee is, said where the advice is
        assert f"{best / knee:.0f}x smaller than the recommended" in said[0]
    assert advice["state_arrays"] == 1 and advice["memory_budget"] == 900_000
    sets = batch_sets(ids, BATCH)
    assert advice["max_unique"] == max(len(u) for u in sets)
    assert advice["curve"]["rows_read"]["lru"][0] == rows_read(
        sets, NUM_ROWS, advice["curve"]["cache_rows"][0], "lru"
    )
    if importlib.util.find_spec("matplotlib") is not None:
        assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_table_gives_the_shape(trace, tmp_path):
    path, _ = trace
    table = tmp_path / "t.zarr"
    embedpipe.Table.create(table, NUM_ROWS, DIM, dtype="float16").close()
    out = tmp_path / "a.json"
    result = run("advise", "--trace", path, "--table", table, "--memory", "2MB", "--sizes", "5%",
                 "300", "--json", out)  # fmt: skip
    assert result.returncode == 0, result.stderr
    advice = json.loads(out.read_text())
    assert (advice["num_rows"], advice["dim"], advice["dtype"]) == (NUM_ROWS, DIM, "float16")
    assert {75, 300} <= set(advice["curve"]["cache_rows"])


@pytest.mark.parametrize(
    "make, args, message",
    [
        (None, ["--trace", "{dir}/missing.npy"], "missing.npy does not exist"),
        ("float", [], "must be integers, got dtype float64"),
        ("3d", [], "(samples, seq_len) or (samples,)"),
        ("big", [], "id 5000 at position"),
        ("text", [], "not a .npy array of token ids"),
        ("ok", ["--memory", "12XB"], "cannot read '12XB' as a memory size"),
        ("ok", ["--sizes", "lots"], "cannot read 'lots' as a cache size"),
        ("ok", ["--memory", "1kB"], "cannot hold even what a pipe"),
        ("ok", ["--table", "{dir}/none.zarr"], "no table at"),
        ("ok", ["--num-rows", None], "give the table's shape"),
        ("ok", ["--workers", "-1"], "--workers must be 0 or more, got -1"),
    ],
)
def test_bad_input_is_one_line(tmp_path, make, args, message):
    trace = tmp_path / "ids.npy"
    arrays = {
        "float": np.ones((4, 3)),
        "3d": np.zeros((2, 2, 2), dtype=np.int64),
        "big": np.array([[1, 5000]]),
        "ok": np.ones((8, 4), dtype=np.int64),
    }
    if make == "text":
        trace.write_text("not numpy")
    elif make is not None:
        np.save(trace, arrays[make])
    shape = {"--trace": str(trace), "--num-rows": "2000", "--dim": "8"}
    for i in range(0, len(args), 2):
        if args[i + 1] is None:
            shape.pop(args[i])
        else:
            shape[args[i]] = args[i + 1].format(dir=tmp_path)
    if "--table" in shape:
        shape.pop("--num-rows")
    result = run("advise", *(x for pair in shape.items() for x in pair))
    assert result.returncode == 1
    assert result.stdout == ""
    error = result.stderr.strip()
    assert "\n" not in error and "Traceback" not in error, error
    assert error.startswith("embedpipe: error: ") and message in error, error


def test_png_without_matplotlib_names_the_extra(trace, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if not installed
    result = run(
        "advise", "--trace", trace[0], "--num-rows", NUM_ROWS, "--dim", DIM, "--png",
        tmp_path / "c.png",
    )  # fmt: skip
    assert result.returncode == 1
    assert result.stderr.strip() == (
        "embedpipe: error: drawing the miss-ratio curve needs matplotlib: "
        "pip install 'embedpipe[plot]'"
    )
    assert not (tmp_path / "c.png").exists()


@pytest.mark.skipif(
    importlib.util.find_spec("embedpipe.tools.benchmark") is None,
    reason="the embedpipe.tools.benchmark package is not in this checkout yet",
)
def test_bench_hands_its_arguments_to_the_benchmark():
    result = run("bench", "--help")
    assert result.returncode == 0, result.stderr
    assert "--quick" in result.stdout
