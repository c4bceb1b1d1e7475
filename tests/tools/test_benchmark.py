"""The benchmark's smoke run: every section at a tiny size, its JSON and its Targets table.

No figure is checked against a speed (the machine is shared; speed lives in the benchmark's own
ratios): only that every section ran, every target has a row, and the report says the same.
"""

from __future__ import annotations

import argparse
import json
import re

import pytest
import torch

from embedpipe.tools import benchmark
from embedpipe.tools.benchmark import distributed, options

TINY = [
    "--quick",
    "--vocab", "600",
    "--dim", "8",
    "--batch-size", "4",
    "--seq-len", "16",
    "--batches", "12",
    "--check-batches", "6",
    "--tput-batches", "3",
    "--train-batches", "2",
    "--repeats", "2",
    "--train-repeats", "2",
    "--min-time", "0",
    "--model-hidden", "8",
    "--model-seq-len", "8",
    "--model-batches", "2",
    "--model-repeats", "1",
    "--handoff-batches", "40",
    "--accel-dim", "8",
    "--accel-batches", "2",
    "--accel-repeats", "1",
    "--accel-ms", "1",
    "--accel-hold", "0.5",
    "--tok-batches", "2",
    "--tok-repeats", "1",
]  # fmt: skip
#: The cold section's options at its smallest, where this checkout has the section.
COLD = [
    "--cold-limit-mib",
    "64",
    "--cold-dim",
    "8",
    "--cold-batches",
    "2",
    "--cold-reads",
    "16",
    "--cold-repeats",
    "1",
]
GOALS = (
    "rows read",
    "(d) frozen",
    "(d) train",
    "(e) train",
    "cold disk",
    "peak memory",
    "hand-off with wrong foresight",
    "owner process",
)


@pytest.fixture
def words(tmp_path):
    """A few hundred words of text for the real-text trace (whatever the machine has installed)."""
    path = tmp_path / "words.txt"
    path.write_text(" ".join(f"word{i % 97} the of a, {i % 13}." for i in range(400)))
    return str(path)


def run(tmp_path, capsys, *extra: str) -> tuple[dict, str]:
    out = tmp_path / "bench.json"
    assert benchmark.main([*TINY, "--dir", str(tmp_path), "--json", str(out), *extra]) == 0
    return json.loads(out.read_text()), capsys.readouterr().out


@pytest.mark.slow
def test_every_section_and_target(tmp_path, capsys, words):
    cold = COLD if "cold" in [s.NAME for s in benchmark.SECTIONS] else []
    result, text = run(tmp_path, capsys, "--text", words, *cold)
    by_default = {s.NAME for s in benchmark.SECTIONS if not getattr(s, "OPT_IN", None)}
    assert set(result["sections"]) == by_default and "distributed" not in by_default
    rows = result["sections"]["rows"]["traces"]
    assert [r["trace"].split()[0] for r in rows] == ["synthetic", "word-level"]
    check = rows[0]["check"]
    assert check["lru"]["pipe"] == check["lru"]["sim"]
    targets = result["targets"]
    for goal in GOALS:
        assert any(goal in t["target"] for t in targets), goal
    reads = [t for t in targets if t["target"].startswith("rows read")]
    assert len(reads) == 2 * 4 + 1  # Zipf and text, at 2, 5, 10 and 20%; a real pipe, workers
    for t in targets:
        assert t["met"] in (True, False, None) and t["goal"], t
    names = [r["name"] for r in result["sections"]["throughput"]["rows"]]
    assert sum(n.startswith("(a)") for n in names) == 4  # frozen and training, 0 and 2 workers
    for r in result["sections"]["throughput"]["rows"]:  # every variant's CPU over its samples
        assert 0 < r["cpu_ms_own"] <= r["cpu_ms_all"], r
    assert any("training process CPU/batch" in t["target"] for t in targets)
    assert text.index("### Targets") < text.index("### Rows read")
    handoff = result["sections"]["handoff"]
    assert all(handoff[p]["first_ms"] > 0 for p in ("lfu", "lookahead", "auto"))
    headings = ("### Throughput", "### Beside a simulated", "### Real model", "### Memory")
    headings += ("### Tokenizing dataset",)
    tokenized = result["sections"]["tokenized"]
    assert [r["name"][:3] for r in tokenized["rows"]] == ["(a)", "(d)", "(a)", "(d)"]
    assert all(r["batches_per_s"] > 0 for r in tokenized["rows"])
    assert result["sections"]["accelerator"]["hold"] == 0.5
    assert "50% of it holding the GIL" in text
    for heading in (*headings, "### Hand-off", "Total time"):
        assert heading in text


def test_skipped_sections_are_not_measured(tmp_path, capsys):
    before = torch.get_num_threads()
    try:
        result, text = run(
            tmp_path, capsys, "--skip", "rows", "handoff", "throughput", "tokenized",
            "accelerator", "model", "cold", "--torch-threads", "3",
        )  # fmt: skip
    finally:
        torch.set_num_threads(before)
    assert result["env"]["torch_threads"] == 3  # the loops ran on 3 of torch's threads
    assert set(result["sections"]) == {"memory"}
    assert all(t["measured"] is None and t["met"] is None for t in result["targets"])
    assert "not measured" in text and "### Rows read" not in text


#: The distributed section at its smallest: one launch of 1 rank and one of 2 (~30 s on 2 cores).
DIST = [
    "--distributed",
    "--skip", "rows", "handoff", "throughput", "tokenized", "accelerator", "model", "memory",
    "cold",
    "--dist-ranks", "1", "2",
    "--dist-batches", "2",
    "--dist-warmup", "1",
    "--dist-rounds", "2",
    "--dist-block", "2",
]  # fmt: skip


@pytest.mark.slow
def test_distributed_section(tmp_path, capsys):
    """1 and 2 ranks under torchrun: every rank reports, the rows one rank fetches are the rows
    the other serves, and the report has a table per rank count; nothing about speed."""
    result, text = run(tmp_path, capsys, *DIST)
    assert set(result["sections"]) == {"distributed"}
    runs = result["sections"]["distributed"]["runs"]
    assert sorted(runs) == ["1", "2"]
    (alone,) = runs["1"]["ranks"]
    assert alone["owned"] == [0, 600] and alone["vs_one_rank"] == 1.0
    assert alone["pipe"]["remote_rows"] == alone["pipe"]["served_rows"] == 0
    pair = runs["2"]["ranks"]
    assert [r["rank"] for r in pair] == [0, 1]
    assert pair[0]["owned"][1] == pair[1]["owned"][0] > 0  # both own rows
    remote = sum(r["pipe"]["remote_rows"] for r in pair)
    assert remote == sum(r["pipe"]["served_rows"] for r in pair) > 0
    for r in pair:
        assert r["pipe"]["sent_bytes"] > 0 and r["pipe"]["steps_per_s"] > 0
        assert r["replicated"]["sent_bytes"] == 600 * 8 * 4  # 2 (N - 1) / N of the gradient
    assert not [t for t in result["targets"] if "distributed" in t["target"]]
    assert "1 rank(s):" in text and "2 rank(s):" in text and "### Scale-out" in text


def test_distributed_summary():
    """The medians, rates and bytes per step of two ranks' records, without launching them."""

    def rank(r: int, unique: int, served: int, remote: int) -> dict:
        # load, read, rows exchange, backward, gradient exchange, step, total; unique, union
        pipe = [[0.01, 0.02, 0.005, 0.03, 0.01, 0.04, 0.1, unique, 50]] * 3
        pipe = [*pipe, [1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 6.0, unique, 50]]  # an outlier
        # load, read, backward, all-reduce, step, total; unique
        rep = [[0.01, 0.01, 0.02, 0.05, 0.03, 0.12, unique]] * 4
        counters = {
            "remote_rows": 4 * remote,
            "served_rows": 4 * served,
            "rows_sent_bytes": 4 * 100,
            "rows_received_bytes": 4 * 200,
            "gradient_sent_bytes": 4 * 1000,
            "gradient_received_bytes": 4 * 3000,
        }
        return {"rank": r, "owned": [r * 8, r * 8 + 8], "pipe": pipe, "replicated": rep,
                "pipe_rates": [5.0, 6.0], "rep_rates": [10.0, 10.0], "counters": counters}  # fmt: skip

    raw = {"world": 2, "ranks": [rank(0, 30, 7, 5), rank(1, 40, 5, 7)]}
    out = distributed.summarise(raw, vocab=16, dim=4)
    assert out["world"] == 2 and out["steps"] == 4
    p, q = out["ranks"][0]["pipe"], out["ranks"][0]["replicated"]
    assert p["lookup_batches_per_s"] == pytest.approx(1 / 0.03)
    assert p["lookup_rows_per_s"] == pytest.approx(30 / 0.03)
    assert p["writeback_rows_per_s"] == pytest.approx(50 / 0.07)
    assert p["steps_per_s"] == pytest.approx(10) and p["exchange_ms"] == pytest.approx(15)
    assert p["sent_bytes"] == 1100 and p["received_bytes"] == 3200  # the counters, per step
    assert p["gradient_sent_bytes"] == 1000
    assert q["steps_per_s"] == pytest.approx(1 / 0.12) and q["exchange_ms"] == pytest.approx(50)
    assert q["writeback_rows_per_s"] == pytest.approx(50 / 0.1)
    assert q["sent_bytes"] == q["received_bytes"] == 16 * 16  # 2 (N - 1) / N x V x D x 4
    assert out["ranks"][0]["vs_replicated"][1] == pytest.approx(0.55)


@pytest.mark.parametrize(
    "parse, text, value",
    [("fraction", "1", 1.0), ("fraction", "0", None), ("fraction", "nan", None),
     ("share", "0", 0.0), ("share", "0.8", 0.8), ("share", "1.5", None), ("share", "inf", None),
     ("share", "-0.1", None)],
)  # fmt: skip
def test_unit_interval_options_name_their_range(parse, text, value):
    if value is None:
        with pytest.raises(argparse.ArgumentTypeError, match=re.escape(text)):
            getattr(options, parse)(text)
    else:
        assert getattr(options, parse)(text) == value
