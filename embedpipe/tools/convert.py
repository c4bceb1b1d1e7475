"""Pre-convert a corpus shard of token ids into ready embeddings, for a frozen table.

:func:`convert` reads a shard (``.npy`` [N, L] ids, ``.jsonl`` with a list of ids per line, a
Parquet file, or a ``datasets`` folder saved with ``save_to_disk``), looks every row up through an
:class:`~embedpipe.EmbeddingPipe` with no optimizer (the same DataLoader workers, shared cache and
table reads as training) and writes a zarr v3 group: ``inputs_embeds`` [N, L, D],
``attention_mask`` [N, L] and the shard's other numeric fields (numbers, [N]; lists of numbers,
padded to [N, L]; fields of text are left out and listed as ``dropped_fields``).
:class:`ConvertedShard` is a map-style Dataset over that group. ``docs/convert.md`` describes
the format and how to train on it. The shard readers are in ``corpus.py``; the reader of the
output, :class:`ConvertedShard`, and the record both sides read, in ``converted.py``.

NOTE [ A conversion is complete only when it says so ]
The group's ``zarr.json`` carries ``attributes["embedpipe_convert"]``: the options, the source,
the table's fingerprint, ``rows_done`` and ``complete``. Arrays are chunked along N by the batch
size, so each batch writes whole chunks; after a batch's chunks are written, ``rows_done`` moves
on. ``complete: true`` is written last. Every rewrite of ``zarr.json`` goes to a temporary file
renamed over it (``os.replace``), so a process killed at any point leaves either the old
attributes or the new ones, never a torn file, and never ``complete`` over missing rows. Nothing
is fsynced: this holds for a killed process, not for a power cut (the chunks may still be in
the page cache when ``complete`` is).
``resume=True`` starts again at ``rows_done`` (a chunk boundary) once the source, the table, its
fingerprint and every option that shapes the bytes match what the group recorded.

NOTE [ bfloat16 ]
zarr v3 has no bfloat16. ``dtype="bfloat16"`` stores the bit patterns as ``uint16`` and records
``"storage": "bfloat16-as-uint16"``; :class:`ConvertedShard` views them back as
``torch.bfloat16``. Other readers get the same with ``torch.from_numpy(a).view(torch.bfloat16)``.
"""

from __future__ import annotations

import datetime
import json
import os
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
import zarr
from torch.utils.data import Dataset, Subset
from tqdm.auto import tqdm

from ..errors import ConversionExistsError, EmbedpipeError, ShardFormatError
from ..store.table import Table
from .converted import ATTRIBUTE, FORMAT_VERSION, ChunkRows, _array_names, _read_record, fingerprint
from .corpus import _KIND_NAMES, LIST_KINDS, open_shard

DTYPES = ("float32", "float16", "bfloat16", "float64")
#: Options recorded in the group that must match for ``resume=True`` to continue it.
RESUME_KEYS = (
    "source",
    "source_stat",
    "table",
    "table_fingerprint",
    "ids_key",
    "num_rows",
    "length",
    "dim",
    "dtype",
    "batch_size",
    "pad_id",
    "full_embedding_block",
    "fields",
)
#: What each per-token field is padded with, besides the ids (as ``collate.PAD_VALUES``).
PAD_VALUES = {"labels": -100}


# --------------------------------------------------------------------------------- collate
class FixedLengthCollate:
    """Collate samples into tensors of one fixed length: per-token fields padded on the right
    (the ids with ``pad_id``, ``labels`` with -100, the rest with 0), and an ``attention_mask``
    (1 on the sample's ids, up to its last id that is not ``pad_id``) unless the shard has its
    own."""

    def __init__(self, length: int, kinds: Mapping[str, str], pad_id: int | None, ids_key: str):
        self.length = length
        self.kinds = dict(kinds)
        self.pad_id = pad_id
        self.ids_key = ids_key

    def __call__(self, samples: list[Mapping[str, Any]]) -> dict[str, torch.Tensor]:
        batch: dict[str, torch.Tensor] = {}
        for field, kind in self.kinds.items():
            values = [s[field] for s in samples]
            if kind not in LIST_KINDS:
                batch[field] = torch.as_tensor(values, dtype=_FIELD_TORCH[kind])
                continue
            pad = self.pad_id if field == self.ids_key else PAD_VALUES.get(field, 0)
            batch[field] = self._pad(field, values, pad, _FIELD_TORCH[kind])
        if "attention_mask" not in batch:
            mask = torch.zeros(len(samples), self.length, dtype=torch.int64)
            for i, s in enumerate(samples):
                mask[i, : self._length(s[self.ids_key])] = 1
            batch["attention_mask"] = mask
        return batch

    def _length(self, ids: Any) -> int:
        """A sample's length: up to its last id that is not ``pad_id`` (a shard padded already,
        a ``.npy`` of fixed-length rows, ends in pad ids that are padding, not tokens)."""
        ids = np.asarray(ids).reshape(-1)[: self.length]
        if self.pad_id is None:
            return len(ids)
        real = np.flatnonzero(ids != self.pad_id)
        return int(real[-1]) + 1 if len(real) else 0

    def _pad(
        self, field: str, values: list[Any], pad: int | None, dtype: torch.dtype
    ) -> torch.Tensor:
        rows = [torch.as_tensor(v) for v in values]
        out = torch.full((len(rows), self.length), 0 if pad is None else pad, dtype=dtype)
        for i, r in enumerate(rows):
            if len(r) > self.length:
                raise ShardFormatError(
                    f"a row's {field!r} has {len(r)} values, more than the length {self.length}: "
                    "raise --max-length (rows are never cut)"
                )
            if len(r) < self.length and pad is None:
                raise ShardFormatError(
                    f"the shard's {field!r} rows have different lengths and no pad id is known: "
                    "pass --pad-id (the table records none)"
                )
            out[i, : len(r)] = r
        return out


_FIELD_TORCH = {
    "int": torch.int64,
    "float": torch.float32,
    "ints": torch.int64,
    "floats": torch.float32,
}


# --------------------------------------------------------------------------------- convert
def convert(
    table: str | os.PathLike[str],
    shard: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    ids_key: str = "input_ids",
    dtype: str | None = None,
    max_length: int | None = None,
    pad_id: int | None = None,
    batch_size: int = 64,
    workers: int = 2,
    cache_rows: int = 32768,
    resume: bool = False,
    full_embedding_block: str | os.PathLike[str] | None = None,
    progress: bool = False,
) -> str:
    """Write the embeddings of every row of ``shard`` into a new zarr group at ``out``.

    Returns ``out``'s absolute path. Lookups run through ``EmbeddingPipe(table, cache_rows=...,
    optimizer=None)`` with ``workers`` DataLoader workers. Ragged rows are padded to the shard's
    longest (or ``max_length``) with ``pad_id`` (default: the table's ``padding_idx``);
    ``dtype`` defaults to the table's. ``full_embedding_block`` (a Hugging Face model folder)
    writes the output of the model's embedding block (word + position + token type embeddings,
    LayerNorm, eval mode) instead of the table's rows. ``resume`` continues a half-done
    conversion at ``out`` (NOTE [ A conversion is complete only when it says so ]).
    """
    out = os.path.abspath(os.path.expanduser(out))
    _check_convert_options(dtype, max_length, batch_size, workers, cache_rows)
    if os.path.lexists(out) and not resume:  # before the shard's pass, which can take long
        raise _exists(out)
    reader = open_shard(shard, ids_key)
    created = False
    with Table.open(table, "r") as tbl:
        _check_destination(out, tbl.path)
        record = _plan(tbl, reader, shard, ids_key, dtype, max_length, pad_id, batch_size)
        block = _embedding_block(full_embedding_block, tbl.dim, record["length"])
        record["full_embedding_block"] = (
            os.path.abspath(full_embedding_block) if full_embedding_block else None
        )
        start = _resume_point(out, record) if resume and os.path.exists(out) else None
        if start is None:
            if os.path.lexists(out):
                raise _exists(out)
            created = True
            start = 0
        try:
            if created:
                _create_output(out, record)
            _fill(tbl, reader, out, record, start, block, workers, cache_rows, progress)
        except BaseException:
            if created and _read_record(out).get("rows_done", 0) == 0:
                shutil.rmtree(out, ignore_errors=True)  # nothing written: leave nothing behind
            raise
    return out


def _plan(
    table: Table,
    reader: Any,
    shard: Any,
    ids_key: str,
    dtype: str | None,
    max_length: int | None,
    pad_id: int | None,
    batch_size: int,
) -> dict[str, Any]:
    """The conversion's record (NOTE [ A conversion is complete only when it says so ]), after
    checking the shard's rows can be padded and its ids are integers."""
    pad_id = table.metadata.get("padding_idx") if pad_id is None else pad_id
    longest, shortest, kinds = reader.scan()
    length = _length(longest, max_length)
    if pad_id is not None and not 0 <= pad_id < table.num_rows:
        raise ValueError(f"pad id {pad_id} is outside the table's 0..{table.num_rows - 1}")
    if pad_id is None and shortest < length:
        raise ShardFormatError(
            f"rows of {shortest} to {longest} ids are padded to {length}, and no pad id is "
            f"known: pass --pad-id (the table {table.path} records no padding_idx)"
        )
    if kinds[ids_key] != "ints":
        raise ShardFormatError(
            f"{shard}: the {ids_key!r} field holds {_KIND_NAMES[kinds[ids_key]]}, not a "
            "list of integer ids"
        )
    return {
        "format_version": FORMAT_VERSION,
        "source": os.path.abspath(os.path.expanduser(shard)),
        "source_stat": _stat(shard),
        "table": table.path,
        "table_step": table.step,
        "table_fingerprint": fingerprint(table),
        "ids_key": ids_key,
        "num_rows": len(reader),
        "length": length,
        "dim": table.dim,
        "dtype": dtype or table.dtype.name,
        "batch_size": batch_size,
        "pad_id": pad_id,
        "fields": {k: v for k, v in kinds.items() if k != ids_key and v != "other"},
        "dropped_fields": sorted(k for k, v in kinds.items() if v == "other"),
    }


def _exists(out: str) -> ConversionExistsError:
    return ConversionExistsError(
        f"{out} already exists; choose a new output path, delete it, or pass "
        "--resume to continue a half-done conversion of the same shard and table"
    )


def _fill(
    table: Table,
    reader: Dataset,
    out: str,
    record: dict[str, Any],
    start: int,
    block: torch.nn.Module | None,
    workers: int,
    cache_rows: int,
    progress: bool,
) -> None:
    """Look up rows ``start:`` through the pipe and write them, a batch (whole chunks) at a time."""
    from ..pipe.handle import EmbeddingPipe

    group = zarr.open_group(out, mode="r+")
    arrays = {name: ChunkRows(out, name, group[name]) for name in _array_names(record)}
    n, length, batch_size = record["num_rows"], record["length"], record["batch_size"]
    collate = FixedLengthCollate(
        length,
        {record["ids_key"]: "ints", **record["fields"]},
        record["pad_id"],
        record["ids_key"],
    )
    rows = Subset(reader, range(start, n)) if start else reader
    bar = tqdm(
        total=n * length,
        initial=start * length,
        unit="tok",
        unit_scale=True,
        desc=f"convert {os.path.basename(out)}",
        disable=not progress,
    )
    done = start
    with bar, EmbeddingPipe(table, cache_rows=cache_rows, optimizer=None) as pipe:
        loader = pipe.loader(
            rows,
            batch_size=batch_size,
            shuffle=False,
            num_workers=workers,
            collate_fn=collate,
            ids_key=record["ids_key"],
            ring_rows=min(table.num_rows, batch_size * length),  # a batch's rows, any ids
        )
        try:
            for batch in loader:
                embeds = batch["inputs_embeds"]
                if block is not None:
                    with torch.no_grad():
                        embeds = block(
                            inputs_embeds=embeds.float(),
                            token_type_ids=batch.get("token_type_ids"),
                        )
                stop = done + len(embeds)
                arrays["inputs_embeds"].write(done, _stored(embeds, record["dtype"]))
                for name in _array_names(record)[1:]:
                    arrays[name].write(done, batch[name].numpy())
                done = stop
                _update_record(out, rows_done=done)
                bar.update(len(embeds) * length)
        except EmbedpipeError as e:  # a worker's error: its own message, rows counted from 0
            raise type(e)(_worker_message(e, start)) from None
    _update_record(
        out,
        complete=True,
        finished=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    )


def _worker_message(error: Exception, start: int) -> str:
    """The checked sample's own message out of torch's "Caught ... in DataLoader worker" text,
    with the sample number counted from the shard's first row (not the resumed part's)."""
    lines = [line for line in str(error).splitlines() if line.strip()] or [type(error).__name__]
    if lines[0].startswith("Caught") and ": " in lines[-1]:
        message = lines[-1].split(": ", 1)[1]
    else:
        message = lines[0]
    number, _, rest = message.removeprefix("sample ").partition(",")
    if not message.startswith("sample ") or not number.isdigit():
        return message
    return f"row {int(number) + start},{rest} (rows are counted from 0)"


def _stored(embeds: torch.Tensor, dtype: str) -> np.ndarray:
    if dtype == "bfloat16":
        return embeds.detach().to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    return embeds.detach().to(getattr(torch, dtype)).numpy()


def _create_output(out: str, record: dict[str, Any]) -> None:
    """The group and its empty arrays, chunked along N by the batch size."""
    n, length, b = record["num_rows"], record["length"], record["batch_size"]
    b = max(1, min(b, n))
    storage = "uint16" if record["dtype"] == "bfloat16" else record["dtype"]
    meta = {
        **record,
        "storage": "bfloat16-as-uint16" if record["dtype"] == "bfloat16" else storage,
        "rows_done": 0,
        "complete": False,
        "started": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }
    group = zarr.open_group(out, mode="w-", zarr_format=3, attributes={ATTRIBUTE: meta})
    group.create_array(
        "inputs_embeds",
        shape=(n, length, record["dim"]),
        chunks=(b, length, record["dim"]),
        dtype=storage,
        compressors=None,
        fill_value=0,
        dimension_names=["row", "position", "dim"],
    )
    for name in _array_names(record)[1:]:
        kind = record["fields"].get(name, "ints")
        token = kind in LIST_KINDS
        group.create_array(
            name,
            shape=(n, length) if token else (n,),
            chunks=(b, length) if token else (b,),
            dtype="float32" if kind in ("float", "floats") else "int64",
            compressors=None,
            fill_value=0,
            dimension_names=["row", "position"] if token else ["row"],
        )


def _update_record(out: str, **values: Any) -> None:
    """Set keys of the group's record, atomically (a temporary file renamed over zarr.json)."""
    path = os.path.join(out, "zarr.json")
    with open(path, encoding="utf-8") as f:
        meta = json.load(f)
    meta["attributes"][ATTRIBUTE].update(values)
    temporary = f"{path}.{os.getpid()}.tmp"
    with open(temporary, "w", encoding="utf-8") as f:
        json.dump(meta, f, indent=2)
    os.replace(temporary, path)


def _resume_point(out: str, record: Mapping[str, Any]) -> int:
    """The row ``resume`` continues from, after checking ``out`` is this conversion half-done."""
    found = _read_record(out)
    if not found:
        raise ConversionExistsError(
            f"{out} exists and is not an embedpipe conversion, so --resume cannot continue it; "
            "choose a new output path"
        )
    if found.get("complete"):
        raise ConversionExistsError(f"{out} is a complete conversion already; nothing to resume")
    for key in RESUME_KEYS:
        if found.get(key) != record[key]:
            raise ConversionExistsError(
                f"{out} is a conversion with {key}={found.get(key)!r}, this one has "
                f"{key}={record[key]!r}: resume with the same shard, table and options, or "
                "choose a new output path"
            )
    return int(found.get("rows_done", 0))


def _stat(path: Any) -> list[int]:
    """Size and modification time of a shard (of its newest file, for a folder): a shard
    rewritten since a conversion began is not resumed."""
    path = os.path.expanduser(path)
    stats = [os.stat(path)]
    if os.path.isdir(path):
        stats += [e.stat() for e in os.scandir(path) if e.is_file()]
    return [sum(s.st_size for s in stats), max(s.st_mtime_ns for s in stats)]


def _length(longest: int, max_length: int | None) -> int:
    if longest == 0:
        raise ShardFormatError("the shard's rows hold no ids: nothing to convert")
    if max_length is None:
        return longest
    if longest > max_length:
        raise ShardFormatError(
            f"the shard's longest row has {longest} ids, more than --max-length {max_length}; "
            "raise it (rows are never cut)"
        )
    return max_length


def _check_destination(out: str, table: str) -> None:
    """Refuse, before the shard's pass, an output whose folder is a file, or inside the table."""
    parent = os.path.dirname(out)
    if os.path.exists(parent) and not os.path.isdir(parent):
        raise FileExistsError(f"{out}: {parent} is a file, not a folder; pick another destination")
    if Path(os.path.realpath(table)) in Path(os.path.realpath(out)).parents:
        raise FileExistsError(
            f"{out} is inside the table {table}; write the conversion outside the table's folder"
        )


def _embedding_block(folder: Any, dim: int, length: int) -> torch.nn.Module | None:
    """The embedding block of the Hugging Face model in ``folder``, in eval mode."""
    if folder is None:
        return None
    if not os.path.isdir(folder):  # (a name would be looked up on the Hugging Face Hub)
        raise ShardFormatError(
            f"--full-embedding-block {folder}: no such folder; give the folder a model was saved "
            "to (save_pretrained)"
        )
    from transformers import AutoModel

    try:
        model = AutoModel.from_pretrained(str(folder), local_files_only=True)
    except (OSError, ValueError) as e:
        raise ShardFormatError(f"--full-embedding-block {folder}: no model to load ({e})") from None
    block = getattr(model, "embeddings", None)
    if block is None:
        raise ShardFormatError(
            f"{type(model).__name__} in {folder} has no .embeddings block (BERT-like models do)"
        )
    hidden = model.config.hidden_size
    if hidden != dim:
        raise ShardFormatError(f"the model in {folder} is {hidden} wide, the table {dim}")
    positions = getattr(model.config, "max_position_embeddings", length)
    if length > positions:
        raise ShardFormatError(
            f"rows of {length} positions are longer than the model's {positions} positions"
        )
    return block.eval()


def _check_convert_options(
    dtype: str | None, max_length: Any, batch_size: Any, workers: Any, cache_rows: Any
) -> None:
    if dtype is not None and dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    for name, value, least in (
        ("batch_size", batch_size, 1),
        ("workers", workers, 0),
        ("cache_rows", cache_rows, 0),
        ("max_length", 1 if max_length is None else max_length, 1),
    ):
        if not isinstance(value, int) or isinstance(value, bool) or value < least:
            raise ValueError(f"{name} must be an integer >= {least}, got {value!r}")
