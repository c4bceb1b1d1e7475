"""embedpipe convert and ConvertedShard: every input format against Table.read, ragged rows,
dtypes, kill and resume, bounded memory, the model's embedding block, and bad input."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
import torch
import zarr

import embedpipe
from embedpipe.errors import ConversionExistsError, IncompleteConversionError
from embedpipe.tools.cli import main
from embedpipe.tools.convert import convert
from embedpipe.tools.converted import ConvertedShard, fingerprint

from ..conftest import tiny_bert_config
from ..helpers import run_cli

ROWS, DIM = 500, 16


@pytest.fixture
def small(tmp_path):
    """A 500 x 16 table of 64-row chunks and its weights."""
    weight = np.random.default_rng(0).standard_normal((ROWS, DIM), dtype=np.float32)
    embedpipe.Table.from_tensor(tmp_path / "t.zarr", weight, chunk_rows=64).close()
    return str(tmp_path / "t.zarr"), weight


def ragged_samples(n: int = 40) -> list[dict]:
    rng = np.random.default_rng(2)
    samples = []
    for i in range(n):
        ids = rng.integers(1, ROWS, 1 + i % 9).tolist()
        samples.append(
            {
                "input_ids": ids,
                "token_type_ids": [i % 2] * len(ids),
                "labels": ids[::-1],
                "score": i / 4,
                "label": i % 3,
                "weights": [0.5] * len(ids),
                "zeros": [0] * len(ids),  # zarr writes no chunk of it
                "text": f"sample {i}",
            }
        )
    return samples


def write_shard(kind: str, folder, samples: list[dict]) -> str:
    if kind == "jsonl":
        path = folder / "s.jsonl"
        path.write_text("".join(json.dumps(s) + "\n" for s in samples))
        return str(path)
    if kind == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        path = folder / "s.parquet"
        pq.write_table(pa.Table.from_pylist(samples), path, row_group_size=7)
        return str(path)
    import datasets

    path = folder / "s.hf"
    datasets.Dataset.from_list(samples).save_to_disk(str(path))
    return str(path)


def test_npy_round_trip_through_workers(tmp_path, small):
    table, _ = small
    ids = np.random.default_rng(1).integers(0, ROWS, (100, 12))
    np.save(tmp_path / "s.npy", ids.astype(np.int32))
    out = convert(table, tmp_path / "s.npy", tmp_path / "o.zarr", batch_size=16, workers=2)
    shard = ConvertedShard(out)
    assert len(shard) == 100 and set(shard[0]) == {"inputs_embeds", "attention_mask"}
    with embedpipe.Table.open(table, "r") as t:
        expected = t.read(ids)
    stored = zarr.open_group(out, mode="r")["inputs_embeds"]
    assert stored.chunks == (16, 12, DIM)  # a batch writes whole chunks
    assert np.array_equal(stored[:], expected)
    assert torch.equal(shard[37]["inputs_embeds"], torch.from_numpy(expected[37]))
    assert shard[-1]["attention_mask"].tolist() == [1] * 12
    record = shard.record
    assert record["source"] == str(tmp_path / "s.npy") and record["table"] == table
    assert record["dtype"] == "float32" and record["table_step"] == 0 and record["complete"]
    with embedpipe.Table.open(table, "r") as t:
        assert record["table_fingerprint"] == fingerprint(t)


@pytest.mark.parametrize("kind", ["jsonl", "parquet", "datasets"])
def test_ragged_round_trip(tmp_path, small, kind):
    table, weight = small
    samples = ragged_samples()
    path = write_shard(kind, tmp_path, samples)
    out = convert(table, path, tmp_path / "o.zarr", batch_size=8, workers=0, pad_id=0)
    shard = ConvertedShard(out)
    assert len(shard) == len(samples) and shard.record["length"] == 9  # the longest row
    for i in (0, 5, 8, 39):
        item, sample = shard[i], samples[i]
        n = len(sample["input_ids"])
        padded = sample["input_ids"] + [0] * (9 - n)
        assert torch.equal(item["inputs_embeds"], torch.from_numpy(weight[padded]))
        assert item["attention_mask"].tolist() == [1] * n + [0] * (9 - n)
        assert item["labels"].tolist() == sample["labels"] + [-100] * (9 - n)
        assert item["token_type_ids"].tolist() == sample["token_type_ids"] + [0] * (9 - n)
        assert item["label"].item() == sample["label"] and item["label"].dtype == torch.int64
        assert item["score"].item() == pytest.approx(sample["score"])
        assert item["weights"].tolist() == [0.5] * n + [0.0] * (9 - n)
        assert item["weights"].dtype == torch.float32 and "text" not in item
    assert shard.record["dropped_fields"] == ["text"]
    group = zarr.open_group(out, mode="r")  # ConvertedShard's own reads agree with zarr's
    for name in ("inputs_embeds", "attention_mask", "labels", "weights", "zeros", "label"):
        rows = torch.stack([shard[i][name] for i in range(len(shard))])
        assert np.array_equal(rows.numpy(), group[name][:]), name


def test_max_length_and_dtypes(tmp_path, small):
    table, weight = small
    path = write_shard("jsonl", tmp_path, ragged_samples(10))
    out = convert(
        table, path, tmp_path / "h.zarr", dtype="float16", max_length=16, pad_id=3, workers=0
    )
    item = ConvertedShard(out)[2]
    assert item["inputs_embeds"].shape == (16, DIM) and item["inputs_embeds"].dtype == torch.float16
    assert torch.equal(item["inputs_embeds"][-1], torch.from_numpy(weight[3]).half())  # pad row

    out = convert(table, path, tmp_path / "b.zarr", dtype="bfloat16", pad_id=0, workers=0)
    shard = ConvertedShard(out)
    embeds = shard[4]["inputs_embeds"]
    assert embeds.dtype == torch.bfloat16 and shard.dtype == torch.bfloat16
    ids = ragged_samples(10)[4]["input_ids"]
    assert torch.equal(embeds[: len(ids)], torch.from_numpy(weight[ids]).bfloat16())
    raw = zarr.open_array(os.path.join(out, "inputs_embeds"), mode="r")  # any zarr reader
    assert raw.dtype == np.uint16
    assert zarr.open_group(out, mode="r").attrs["embedpipe_convert"]["storage"] == (
        "bfloat16-as-uint16"
    )


def test_ragged_without_pad_id_and_too_long(tmp_path, small):
    table, _ = small
    path = write_shard("jsonl", tmp_path, ragged_samples(10))
    with pytest.raises(ValueError, match="no pad id is known: pass --pad-id"):
        convert(table, path, tmp_path / "o.zarr", workers=0)
    assert not (tmp_path / "o.zarr").exists()  # nothing written, nothing left
    with pytest.raises(ValueError, match="more than --max-length 4"):
        convert(table, path, tmp_path / "o.zarr", workers=0, pad_id=0, max_length=4)
    assert not (tmp_path / "o.zarr").exists()


def test_padding_idx_of_the_table(tmp_path):
    weight = np.random.default_rng(0).standard_normal((ROWS, DIM), dtype=np.float32)
    with embedpipe.Table.from_tensor(tmp_path / "t.zarr", weight) as t:
        t.update_metadata(padding_idx=7)
        t.checkpoint()
    path = write_shard("jsonl", tmp_path, ragged_samples(10))
    out = convert(tmp_path / "t.zarr", path, tmp_path / "o.zarr", workers=0)
    assert ConvertedShard(out).record["pad_id"] == 7
    assert torch.equal(ConvertedShard(out)[0]["inputs_embeds"][-1], torch.from_numpy(weight[7]))


def test_incomplete_and_changed_table(tmp_path, small):
    table, weight = small
    np.save(tmp_path / "s.npy", np.arange(40).reshape(10, 4))
    out = convert(table, tmp_path / "s.npy", tmp_path / "o.zarr", workers=0, batch_size=4)
    with embedpipe.Table.open(table, "r+") as t:
        t.write([1], weight[[2]])
        t.checkpoint()
    with pytest.warns(UserWarning, match="has changed since"):
        ConvertedShard(out)

    meta_path = tmp_path / "o.zarr" / "zarr.json"
    meta = json.loads(meta_path.read_text())
    meta["attributes"]["embedpipe_convert"]["complete"] = False
    meta_path.write_text(json.dumps(meta))
    with pytest.raises(IncompleteConversionError, match="incomplete conversion"):
        ConvertedShard(out)


def test_existing_output_and_resume_checks(tmp_path, small):
    table, _ = small
    np.save(tmp_path / "s.npy", np.arange(40).reshape(10, 4))
    np.save(tmp_path / "u.npy", np.arange(40).reshape(10, 4))
    out = convert(table, tmp_path / "s.npy", tmp_path / "o.zarr", workers=0, batch_size=4)
    with pytest.raises(ConversionExistsError, match="already exists"):
        convert(table, tmp_path / "s.npy", out, workers=0, batch_size=4)
    with pytest.raises(ConversionExistsError, match="complete conversion already"):
        convert(table, tmp_path / "s.npy", out, workers=0, batch_size=4, resume=True)
    (tmp_path / "other").mkdir()
    with pytest.raises(ConversionExistsError, match="is not an embedpipe conversion"):
        convert(table, tmp_path / "s.npy", tmp_path / "other", workers=0, resume=True)
    assert os.listdir(tmp_path / "other") == []  # left as it was

    meta_path = tmp_path / "o.zarr" / "zarr.json"
    meta = json.loads(meta_path.read_text())
    meta["attributes"]["embedpipe_convert"]["complete"] = False
    meta_path.write_text(json.dumps(meta))
    with pytest.raises(ConversionExistsError, match="source="):
        convert(table, tmp_path / "u.npy", out, workers=0, batch_size=4, resume=True)
    with pytest.raises(ConversionExistsError, match="batch_size=4"):
        convert(table, tmp_path / "s.npy", out, workers=0, batch_size=8, resume=True)
    np.save(tmp_path / "s.npy", np.arange(40).reshape(10, 4) + 1)  # the shard rewritten
    with pytest.raises(ConversionExistsError, match="source_stat="):
        convert(table, tmp_path / "s.npy", out, workers=0, batch_size=4, resume=True)


@pytest.mark.parametrize(
    ("make", "message"),
    [
        ("float", "integer token ids of shape [N, L], got float64"),
        ("garbage", "is not a readable .npy file"),
        ("csv", "unknown shard type '.csv'"),
        ("nokey", "has no 'input_ids' field"),
        ("badjson", "s.jsonl:2 is not JSON"),
        ("missing", "does not exist"),
        ("parquet", "is not a readable Parquet file"),
        ("empty", "holds no rows: nothing to convert"),
        ("floatids", "holds a list of numbers, not a list of integer ids"),
        ("ragged", "rows of 1 to 3 ids are padded to 3, and no pad id is known: pass --pad-id"),
    ],
)
def test_bad_shards(tmp_path, small, make, message, capsys):
    table, _ = small
    path = {
        "float": "s.npy",
        "garbage": "s.npy",
        "csv": "s.csv",
        "nokey": "s.jsonl",
        "badjson": "s.jsonl",
        "missing": "s.npy",
        "parquet": "s.parquet",
        "empty": "s.npy",
        "floatids": "s.jsonl",
        "ragged": "s.jsonl",
    }[make]
    if make == "float":
        np.save(tmp_path / path, np.zeros((4, 4)))
    elif make in ("garbage", "csv", "parquet"):
        (tmp_path / path).write_bytes(b"not a shard\n")
    elif make == "nokey":
        (tmp_path / path).write_text('{"ids": [1, 2]}\n')
    elif make == "empty":
        np.save(tmp_path / path, np.zeros((0, 4), dtype=np.int64))
    elif make == "floatids":
        (tmp_path / path).write_text('{"input_ids": [1, 2.5]}\n')
    elif make == "ragged":
        (tmp_path / path).write_text('{"input_ids": [1, 2, 3]}\n{"input_ids": [4]}\n')
    elif make == "badjson":
        (tmp_path / path).write_text('{"input_ids": [1, 2]}\n{"input_ids": [1,\n')
    assert main(["convert", table, str(tmp_path / path), str(tmp_path / "o.zarr")]) == 1
    assert message in error_line(capsys.readouterr().err)
    assert not (tmp_path / "o.zarr").exists()


def test_id_out_of_range_names_it(tmp_path, small):
    table, _ = small
    ids = np.ones((64, 8), dtype=np.int64)
    for first in (True, False):
        ids[37, 5], ids[3, 2] = (1, ROWS + 9) if first else (ROWS + 9, 1)
        np.save(tmp_path / "s.npy", ids)
        out = tmp_path / f"o{first}.zarr"
        result = run_cli("convert", table, tmp_path / "s.npy", out, "--batch-size", "8")
        assert result.returncode == 1
        row, position = (3, 2) if first else (37, 5)
        message = f"row {row}, 'input_ids': id {ROWS + 9} at position {position}"
        assert message in error_line(result.stderr)
        if first:
            assert not out.exists()  # failed before a row was written
        else:
            with pytest.raises(IncompleteConversionError):
                ConvertedShard(out)  # rows 0..31 written, never complete


def test_output_exists_from_the_cli(tmp_path, small):
    table, _ = small
    np.save(tmp_path / "s.npy", np.ones((4, 4), dtype=np.int64))
    (tmp_path / "o.zarr").mkdir()
    result = run_cli("convert", table, tmp_path / "s.npy", tmp_path / "o.zarr")
    assert result.returncode == 1 and "pass --resume" in result.stderr
    result = run_cli("convert", table, tmp_path / "s.npy", tmp_path / "n.zarr", "--workers", "0")
    assert result.returncode == 0, result.stderr
    assert "inputs_embeds [4, 4, 16] float32" in result.stdout and "tok/s" in result.stderr


def error_line(stderr: str) -> str:
    """The one error line (progress bars aside), which ends the output."""
    errors = [line for line in stderr.splitlines() if line.startswith("embedpipe: error:")]
    assert len(errors) == 1 and stderr.strip().endswith(errors[0]), stderr
    return errors[0]


def _rows_done(out) -> int:
    try:
        meta = json.loads((out / "zarr.json").read_text())
    except (OSError, ValueError):
        return 0
    return meta["attributes"]["embedpipe_convert"]["rows_done"]


@pytest.mark.slow
def test_kill_and_resume_gives_the_same_bytes(tmp_path, small):
    table, _ = small
    ids = np.random.default_rng(3).integers(0, ROWS, (6000, 32))
    np.save(tmp_path / "s.npy", ids)
    args = [sys.executable, "-m", "embedpipe", "convert", table, tmp_path / "s.npy"]
    options = ["--batch-size", "8", "--cache-rows", "50", "--workers", "2"]
    process = subprocess.Popen(
        [*map(str, args), str(tmp_path / "k.zarr"), *options],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,  # its workers in its process group, killed with it
    )
    deadline = time.monotonic() + 60
    while _rows_done(tmp_path / "k.zarr") < 400 and time.monotonic() < deadline:
        assert process.poll() is None, "the conversion finished before it could be killed"
        time.sleep(0.01)
    os.killpg(process.pid, signal.SIGKILL)
    process.wait()
    done = _rows_done(tmp_path / "k.zarr")
    assert 400 <= done < 6000 and done % 8 == 0
    with pytest.raises(IncompleteConversionError):
        ConvertedShard(tmp_path / "k.zarr")

    result = run_cli(*args[3:], tmp_path / "k.zarr", *options, "--resume")
    assert result.returncode == 0, result.stderr
    convert(table, tmp_path / "s.npy", tmp_path / "u.zarr", batch_size=8, workers=0)
    for name in ("inputs_embeds", "attention_mask"):
        killed = zarr.open_array(str(tmp_path / "k.zarr" / name), mode="r")[:]
        whole = zarr.open_array(str(tmp_path / "u.zarr" / name), mode="r")[:]
        assert killed.tobytes() == whole.tobytes()
    assert ConvertedShard(tmp_path / "k.zarr").record["complete"]


@pytest.mark.slow
def test_memory_stays_bounded(tmp_path):
    """A 250 MiB output through a 50-row cache: the converting process grows by a few batches.

    glibc's malloc raises its mmap threshold after the first large free, so freed 2 MiB batches
    then stay in the heap arenas (up to about 100 MiB here, the same for a 750 MiB output):
    bounded, but not by what convert holds. A fixed threshold measures what convert holds.
    """
    weight = np.random.default_rng(0).standard_normal((ROWS, 256), dtype=np.float32)
    embedpipe.Table.from_tensor(tmp_path / "t.zarr", weight, chunk_rows=64).close()
    np.save(tmp_path / "s.npy", np.random.default_rng(1).integers(0, ROWS, (4000, 64)))
    script = textwrap.dedent(
        f"""
        import resource, embedpipe.pipe, zarr
        from embedpipe.tools.convert import convert
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        convert({str(tmp_path / "t.zarr")!r}, {str(tmp_path / "s.npy")!r},
                {str(tmp_path / "o.zarr")!r}, batch_size=32, workers=2, cache_rows=50)
        print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before)
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "MALLOC_MMAP_THRESHOLD_": str(128 * 1024)},
    )
    assert result.returncode == 0, result.stderr
    growth = int(result.stdout.split()[-1]) * 1024  # ru_maxrss is in KiB on Linux
    output = 4000 * 64 * 256 * 4
    batch = 32 * 64 * 256 * 4
    assert growth < 16 * batch < output / 7, f"grew {growth / 2**20:.0f} MiB"


@pytest.fixture
def bert_table(tmp_path, bert_folder):
    folder, _ = bert_folder
    embedpipe.import_table(folder, tmp_path / "bert.zarr").close()
    return folder, str(tmp_path / "bert.zarr")


def test_full_embedding_block_equals_the_models(tmp_path, bert_table):
    from transformers import BertModel
    from transformers.masking_utils import create_bidirectional_mask

    folder, table = bert_table
    samples = [
        {
            "input_ids": [int(x) for x in np.arange(1, 4 + i) * 7 % 1000],
            "token_type_ids": [1] * (3 + i),
        }
        for i in range(12)
    ]
    path = write_shard("jsonl", tmp_path, samples)
    out = convert(
        table, path, tmp_path / "o.zarr", pad_id=0, workers=0, full_embedding_block=folder
    )
    shard = ConvertedShard(out)
    assert shard.record["full_embedding_block"] == str(folder)
    model = BertModel.from_pretrained(folder).eval()
    batch = next(iter(torch.utils.data.DataLoader(shard, batch_size=12)))
    ids = torch.zeros(12, 14, dtype=torch.int64)
    types = torch.zeros(12, 14, dtype=torch.int64)
    for i, s in enumerate(samples):
        ids[i, : len(s["input_ids"])] = torch.tensor(s["input_ids"])
        types[i, : len(s["input_ids"])] = 1
    with torch.no_grad():
        expected = model.embeddings(input_ids=ids, token_type_ids=types)
        torch.testing.assert_close(batch["inputs_embeds"], expected, rtol=0, atol=1e-6)
        # the encoder runs on it directly, as the model does on input_ids
        mask = create_bidirectional_mask(
            config=model.config,
            inputs_embeds=batch["inputs_embeds"],
            attention_mask=batch["attention_mask"],
        )
        hidden = model.encoder(batch["inputs_embeds"], attention_mask=mask).last_hidden_state
        whole = model(input_ids=ids, token_type_ids=types, attention_mask=batch["attention_mask"])
        torch.testing.assert_close(hidden, whole.last_hidden_state, rtol=0, atol=1e-5)


def test_a_tiny_bert_trains_on_a_converted_shard(tmp_path, small):
    from transformers import BertForSequenceClassification

    table, _ = small
    rng = np.random.default_rng(4)
    samples = []
    for i in range(64):  # the label is whether the row starts with a low id
        ids = rng.integers(1, ROWS, 1 + i % 10).tolist()
        samples.append({"input_ids": ids, "labels": int(ids[0] < ROWS // 2)})
    path = write_shard("jsonl", tmp_path, samples)
    out = convert(table, path, tmp_path / "o.zarr", pad_id=0, workers=0)
    torch.manual_seed(0)
    model = BertForSequenceClassification(tiny_bert_config(ROWS, hidden_size=DIM))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    loader = torch.utils.data.DataLoader(
        ConvertedShard(out), batch_size=16, shuffle=True, num_workers=2
    )
    losses = []
    for _ in range(15):
        for batch in loader:
            loss = model(
                inputs_embeds=batch["inputs_embeds"],
                attention_mask=batch["attention_mask"],
                labels=batch["labels"],
            ).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
    assert np.mean(losses[-4:]) < 0.5 * np.mean(losses[:4])


def test_a_zero_padded_npy_shard_gets_its_padding_masked(tmp_path, small):
    """Rows of a .npy shard are padded already; with pad_id 0 the mask ends at each row's last
    id that is not 0 (before: all ones, so the model attended to the padding)."""
    table, _ = small
    ids = np.random.default_rng(2).integers(1, ROWS, (20, 8))
    lengths = np.random.default_rng(3).integers(1, 9, 20)
    for row, n in zip(ids, lengths):
        row[n:] = 0
    ids[0, 2] = 0  # a pad id inside a sample stays a token
    np.save(tmp_path / "s.npy", ids)
    shard = ConvertedShard(convert(table, tmp_path / "s.npy", tmp_path / "o.zarr", pad_id=0))
    for i in range(20):
        n = int(np.flatnonzero(ids[i])[-1]) + 1  # the last id that is not padding
        assert n == lengths[i] or (i == 0 and n == max(lengths[0], 3))
        assert shard[i]["attention_mask"].tolist() == [1] * n + [0] * (8 - n), i
