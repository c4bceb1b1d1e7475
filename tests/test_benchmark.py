"""The benchmark's smoke run: every section at a tiny size, its JSON and its Targets table.

No figure is checked against a speed (the machine is shared; speed lives in the benchmark's own
ratios): only that every section ran, every target has a row, and the report says the same.
"""

from __future__ import annotations

import json

import pytest

from embedpipe import benchmark

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
GOALS = ("rows read", "(d) frozen", "(d) train", "(e) train", "cold disk", "peak memory")


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


def test_every_section_and_target(tmp_path, capsys, words):
    cold = COLD if "cold" in [s.NAME for s in benchmark.SECTIONS] else []
    result, text = run(tmp_path, capsys, "--text", words, *cold)
    assert set(result["sections"]) == {s.NAME for s in benchmark.SECTIONS}
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
    assert text.index("### Targets") < text.index("### Rows read")
    for heading in ("### Throughput", "### Real model", "### Memory", "Total time"):
        assert heading in text


def test_skipped_sections_are_not_measured(tmp_path, capsys):
    result, text = run(tmp_path, capsys, "--skip", "rows", "throughput", "model", "cold")
    assert set(result["sections"]) == {"memory"}
    assert all(t["measured"] is None and t["met"] is None for t in result["targets"])
    assert "not measured" in text and "### Rows read" not in text
