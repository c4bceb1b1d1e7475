"""Pre-convert a corpus shard of token ids into ready embeddings, for a frozen table.

:func:`convert` reads a shard (``.npy`` [N, L] ids, ``.jsonl`` with a list of ids per line, a
Parquet file, or a ``datasets`` folder saved with ``save_to_disk``), looks every row up through an
:class:`~embedpipe.EmbeddingPipe` with no optimizer (the same DataLoader workers, shared cache and
table reads as training) and writes a zarr v3 group: ``inputs_embeds`` [N, L, D],
``attention_mask`` [N, L] and the shard's other numeric fields (numbers, [N]; lists of numbers,
padded to [N, L]; fields of text are left out and listed as ``dropped_fields``).
:class:`ConvertedShard` is a map-style Dataset over that group. ``docs/convert.md`` describes
the format and how to train on it.

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

import bisect
import datetime
import hashlib
import json
import os
import shutil
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
import zarr
from torch.utils.data import Dataset, Subset
from tqdm.auto import tqdm

from .errors import (
    ConversionExistsError,
    EmbedpipeError,
    IncompleteConversionError,
    ShardFormatError,
)
from .table import Table

#: The group attribute holding the conversion's record (NOTE [ A conversion is complete ... ]).
ATTRIBUTE = "embedpipe_convert"
FORMAT_VERSION = 1
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
SUFFIXES = (".npy", ".jsonl", ".parquet")


# --------------------------------------------------------------------------------- shards
class NpyShard(Dataset):
    """A ``.npy`` file of integer ids [N, L], memory-mapped: each item reads one row."""

    def __init__(self, path: str, ids_key: str = "input_ids") -> None:
        self.path = path
        self.ids_key = ids_key
        array = _load_npy(path)
        if array.ndim != 2 or not np.issubdtype(array.dtype, np.integer):
            raise ShardFormatError(
                f"{path}: a .npy shard holds integer token ids of shape [N, L], got "
                f"{array.dtype} of shape {list(array.shape)}"
            )
        self.shape = array.shape
        self._array: np.ndarray | None = array

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, index: int) -> dict[str, Any]:
        if self._array is None:
            self._array = _load_npy(self.path)
        return {self.ids_key: torch.from_numpy(np.array(self._array[index], dtype=np.int64))}

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_array": None}  # each process maps the file itself

    def scan(self) -> tuple[int, int, dict[str, str]]:
        """The longest row of any list field, the shortest ids row, and each field's kind."""
        return self.shape[1], self.shape[1], {self.ids_key: "ints"}


class JsonlShard(Dataset):
    """A ``.jsonl`` file, one JSON object per line, found through a byte-offset index built in
    one pass (which also checks every line and measures the longest row)."""

    def __init__(self, path: str, ids_key: str = "input_ids") -> None:
        self.path = path
        self.ids_key = ids_key
        self._file: Any = None
        self._pid = -1
        offsets: list[int] = []
        longest, shortest, kinds = 0, None, {}
        with open(path, "rb") as f:
            position = 0
            for number, line in enumerate(f, 1):
                if line.strip():
                    sample = _parse_line(line, path, number, ids_key)
                    longest = max(longest, _merge_kinds(kinds, sample, f"{path}:{number}"))
                    n = len(sample[ids_key]) if _kind(sample[ids_key]) in LIST_KINDS else 0
                    shortest = n if shortest is None else min(shortest, n)
                    offsets.append(position)
                position += len(line)
        if not offsets:
            raise ShardFormatError(f"{path} holds no lines; a .jsonl shard has one object a line")
        self.offsets = np.asarray(offsets, dtype=np.int64)
        self._scan = (longest, shortest or 0, kinds)

    def __len__(self) -> int:
        return len(self.offsets)

    def __getitem__(self, index: int) -> dict[str, Any]:
        if self._file is None or self._pid != os.getpid():
            self._file, self._pid = open(self.path, "rb"), os.getpid()  # noqa: SIM115
        self._file.seek(int(self.offsets[index]))
        return json.loads(self._file.readline())

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_file": None, "_pid": -1}

    def scan(self) -> tuple[int, int, dict[str, str]]:
        return self._scan


class ArrowShard(Dataset):
    """A Parquet file (row groups read lazily, one held at a time per process) or a ``datasets``
    folder (``load_from_disk``, memory-mapped)."""

    def __init__(self, path: str, ids_key: str = "input_ids") -> None:
        self.path = path
        self.ids_key = ids_key
        self._held: tuple[int, list[dict[str, Any]]] | None = None
        self._source: Any = None
        self._open()
        if ids_key not in self.columns:
            raise ShardFormatError(
                f"{path} has no column {ids_key!r} (columns: {', '.join(self.columns)}); "
                "name the ids with --ids-key"
            )

    def _open(self) -> Any:
        if self._source is not None:
            return self._source
        if os.path.isdir(self.path):
            try:
                import datasets
            except ImportError:
                raise ShardFormatError(
                    f"{self.path} is a folder; reading a Hugging Face datasets folder needs the "
                    "optional dependency: pip install datasets"
                ) from None
            try:
                source = datasets.load_from_disk(self.path)
            except FileNotFoundError as e:
                raise ShardFormatError(
                    f"{self.path} is not a datasets folder saved with save_to_disk ({e})"
                ) from None
            if not isinstance(source, datasets.Dataset):
                raise ShardFormatError(
                    f"{self.path} holds several splits ({', '.join(source)}); convert one split's "
                    "folder at a time"
                )
            self.columns = list(source.column_names)
            self.starts = [0, len(source)]
        else:
            try:
                import pyarrow.parquet as pq
            except ImportError:
                raise ShardFormatError(
                    f"reading {self.path} needs the optional dependency: pip install pyarrow"
                ) from None
            try:
                source = pq.ParquetFile(self.path)
            except Exception as e:  # pyarrow raises ArrowInvalid and friends
                raise ShardFormatError(
                    f"{self.path} is not a readable Parquet file ({e})"
                ) from None
            self.columns = list(source.schema_arrow.names)
            rows = [source.metadata.row_group(i).num_rows for i in range(source.num_row_groups)]
            self.starts = [0, *np.cumsum(rows).tolist()]
        self._source = source
        return source

    def __len__(self) -> int:
        return self.starts[-1]

    def __getitem__(self, index: int) -> dict[str, Any]:
        source = self._open()
        if not hasattr(source, "read_row_group"):  # a datasets.Dataset reads rows itself
            return source[int(index)]
        group = bisect.bisect_right(self.starts, index) - 1
        if self._held is None or self._held[0] != group:
            self._held = (group, source.read_row_group(group).to_pylist())
        return self._held[1][index - self.starts[group]]

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_source": None, "_held": None}

    def scan(self) -> tuple[int, int, dict[str, str]]:
        """The longest and shortest ids rows, from the column's list lengths; the kinds from
        the first row."""
        import pyarrow.compute as pc

        source = self._open()
        longest, shortest = 0, None
        if hasattr(source, "read_row_group"):
            columns = (
                source.read_row_group(i, columns=[self.ids_key]).column(0)
                for i in range(source.num_row_groups)
            )
        else:
            columns = iter([source.data.column(self.ids_key)])
        for column in columns:
            try:
                lengths = pc.list_value_length(column)
            except Exception:
                raise ShardFormatError(
                    f"{self.path}: column {self.ids_key!r} is {column.type}, not a list of ids"
                ) from None
            if len(lengths):
                longest = max(longest, int(pc.max(lengths).as_py() or 0))
                least = int(pc.min(lengths).as_py() or 0)
                shortest = least if shortest is None else min(shortest, least)
        schema = source.schema_arrow if hasattr(source, "read_row_group") else source.data.schema
        kinds = {field.name: _arrow_kind(field.type) for field in schema}
        if kinds[self.ids_key] not in LIST_KINDS:
            raise ShardFormatError(f"{self.path}: column {self.ids_key!r} is not a list of ids")
        return longest, shortest or 0, kinds


def _arrow_kind(kind: Any) -> str:
    """:func:`_kind` of an Arrow column type (every row of a column has it)."""
    import pyarrow as pa

    if pa.types.is_list(kind) or pa.types.is_large_list(kind) or pa.types.is_fixed_size_list(kind):
        inner = _arrow_kind(kind.value_type)
        return {"int": "ints", "float": "floats"}.get(inner, "other")
    if pa.types.is_integer(kind) or pa.types.is_boolean(kind):
        return "int"
    if pa.types.is_floating(kind):
        return "float"
    return "other"


def open_shard(path: str | os.PathLike[str], ids_key: str = "input_ids") -> Dataset:
    """The reader for ``path`` by its suffix (a folder: a ``datasets`` folder)."""
    path = os.path.abspath(os.path.expanduser(path))
    if not os.path.exists(path):
        raise FileNotFoundError(
            f"{path} does not exist; give a .npy, .jsonl or .parquet shard or a datasets folder"
        )
    suffix = Path(path).suffix.lower()
    if os.path.isdir(path) or suffix == ".parquet":
        reader: Dataset = ArrowShard(path, ids_key)
    elif suffix == ".npy":
        reader = NpyShard(path, ids_key)
    elif suffix == ".jsonl":
        reader = JsonlShard(path, ids_key)
    else:
        raise ShardFormatError(
            f"{path}: unknown shard type {suffix!r}; give one of {', '.join(SUFFIXES)} or a "
            "datasets folder saved with save_to_disk"
        )
    if len(reader) == 0:
        raise ShardFormatError(f"{path} holds no rows: nothing to convert")
    return reader


def _load_npy(path: str) -> np.ndarray:
    try:
        return np.load(path, mmap_mode="r", allow_pickle=False)
    except (ValueError, OSError) as e:
        raise ShardFormatError(f"{path} is not a readable .npy file ({e})") from None


def _parse_line(line: bytes, path: str, number: int, ids_key: str) -> dict[str, Any]:
    try:
        sample = json.loads(line)
    except ValueError as e:
        raise ShardFormatError(f"{path}:{number} is not JSON ({e})") from None
    if not isinstance(sample, dict) or ids_key not in sample:
        raise ShardFormatError(
            f"{path}:{number} has no {ids_key!r} field; each line must be an object with the "
            "ids as a list (name the field with --ids-key)"
        )
    return sample


def _kind(value: Any) -> str:
    """``ints``/``floats`` for a list of numbers (padded to the length), ``int``/``float`` for a
    number, ``other`` for anything else."""
    if isinstance(value, (np.ndarray, torch.Tensor)):
        return "floats" if value.dtype.is_floating_point or value.dtype.kind == "f" else "ints"
    if isinstance(value, (list, tuple)):
        if not all(isinstance(x, (int, float, np.integer, np.floating)) for x in value):
            return "other"
        return "floats" if any(isinstance(x, (float, np.floating)) for x in value) else "ints"
    if isinstance(value, (bool, int, np.integer)):
        return "int"
    if isinstance(value, (float, np.floating)):
        return "float"
    return "other"


def _merge_kinds(kinds: dict[str, str], sample: Mapping[str, Any], where: str) -> int:
    """Record each field's kind in ``kinds`` (checking it agrees with earlier samples) and
    return the length of the longest per-token field of ``sample``."""
    longest = 0
    for field, value in sample.items():
        kind = _kind(value)
        known = kinds.setdefault(field, kind)
        if known != kind and {kind, known} not in ({"int", "float"}, {"ints", "floats"}):
            raise ShardFormatError(
                f"{where}: field {field!r} is {_KIND_NAMES[kind]} here and "
                f"{_KIND_NAMES[known]} in earlier rows"
            )
        if kind in ("float", "floats"):
            kinds[field] = kind
        if kind in LIST_KINDS:
            longest = max(longest, len(value))
    return longest


LIST_KINDS = ("ints", "floats")
_KIND_NAMES = {
    "ints": "a list of integers",
    "floats": "a list of numbers",
    "int": "an integer",
    "float": "a number",
    "other": "neither numbers nor a list of numbers",
}


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
    from .pipe import EmbeddingPipe

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


def _array_names(record: Mapping[str, Any]) -> list[str]:
    """``inputs_embeds`` first, then ``attention_mask`` and the copied fields."""
    return ["inputs_embeds", *dict.fromkeys(["attention_mask", *record["fields"]])]


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


def _read_record(out: str) -> dict[str, Any]:
    try:
        with open(os.path.join(out, "zarr.json"), encoding="utf-8") as f:
            return json.load(f).get("attributes", {}).get(ATTRIBUTE) or {}
    except (OSError, ValueError):
        return {}


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


def _embedding_block(folder: Any, dim: int, length: int) -> torch.nn.Module | None:
    """The embedding block of the Hugging Face model in ``folder``, in eval mode."""
    if folder is None:
        return None
    from transformers import AutoModel

    try:
        model = AutoModel.from_pretrained(str(folder))
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


def fingerprint(table: Table) -> str:
    """A blake2b hash of the table's weights (streamed a block at a time), shape and dtype."""
    digest = hashlib.blake2b(digest_size=16)
    digest.update(f"{table.num_rows}x{table.dim}:{table.dtype.name}".encode())
    for block in table.iter_blocks():
        digest.update(np.ascontiguousarray(block).tobytes())
    return digest.hexdigest()


# --------------------------------------------------------------------------------- reading
class ConvertedShard(Dataset):
    """A map-style Dataset over a conversion made by :func:`convert`: item ``i`` is a dict of
    tensors, ``inputs_embeds`` (L, D), ``attention_mask`` (L,) and the copied fields, read
    lazily, one ``pread`` per array (NOTE [ Reading one row ]); each process opens its own
    handles, so DataLoader workers can share it.

    Raises :class:`~embedpipe.errors.IncompleteConversionError` for a conversion that never
    finished; warns (``UserWarning``) when the table it was made from has changed since.
    """

    def __init__(self, path: str | os.PathLike[str], check_table: bool = True) -> None:
        self.path = os.path.abspath(os.path.expanduser(path))
        if not os.path.isdir(self.path):
            raise FileNotFoundError(f"{self.path} does not exist; give the folder convert wrote")
        record = _read_record(self.path)
        if not record:
            raise ShardFormatError(f"{self.path} is not an embedpipe conversion (no {ATTRIBUTE})")
        if record.get("format_version", 0) > FORMAT_VERSION:
            raise ShardFormatError(
                f"{self.path} is a conversion of format {record['format_version']}; this "
                f"embedpipe reads format {FORMAT_VERSION}: upgrade embedpipe"
            )
        if not record.get("complete"):
            raise IncompleteConversionError(
                f"{self.path} is an incomplete conversion ({record.get('rows_done', 0)} of "
                f"{record.get('num_rows')} rows written); finish it with embedpipe convert ... "
                "--resume"
            )
        self.record = record
        self.names = _array_names(record)
        self._arrays: dict[str, Any] | None = None
        self._pid = -1
        if check_table:
            self._check_table()

    def _check_table(self) -> None:
        path = self.record["table"]
        if not os.path.exists(path):
            return
        try:
            with Table.open(path, "r") as table:
                now = fingerprint(table)
        except EmbedpipeError:
            return
        if now != self.record["table_fingerprint"]:
            warnings.warn(
                f"the table {path} has changed since {self.path} was converted from it (step "
                f"{self.record['table_step']} then); convert the shard again for its new rows",
                UserWarning,
                stacklevel=3,
            )

    @property
    def dtype(self) -> torch.dtype:
        return getattr(torch, self.record["dtype"])

    def __len__(self) -> int:
        return int(self.record["num_rows"])

    def _open(self) -> dict[str, ChunkRows]:
        if self._arrays is None or self._pid != os.getpid():
            group = zarr.open_group(self.path, mode="r")
            self._arrays = {name: ChunkRows(self.path, name, group[name]) for name in self.names}
            self._pid = os.getpid()
        return self._arrays

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if not -len(self) <= index < len(self):
            raise IndexError(f"row {index} is outside the {len(self)} rows of {self.path}")
        index = int(index) % len(self)
        arrays = self._open()
        item = {name: torch.from_numpy(a.read(index)) for name, a in arrays.items()}
        if self.record["dtype"] == "bfloat16":
            item["inputs_embeds"] = item["inputs_embeds"].view(torch.bfloat16)
        return item

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_arrays": None, "_pid": -1}

    def __repr__(self) -> str:
        r = self.record
        return f"ConvertedShard({self.path!r}, [{r['num_rows']}, {r['length']}, {r['dim']}] {r['dtype']})"


class ChunkRows:
    """Rows of an uncompressed array convert writes: a batch written as its chunk file, a row
    read straight from its chunk file.

    NOTE [ Reading one row ]
    Arrays are chunked by the batch size along N, so a chunk of ``inputs_embeds`` holds a whole
    batch (64 x 512 x 768 float32 is 96 MiB); zarr reads the whole chunk for one row. A chunk
    file of an array with only the ``bytes`` codec is its C-ordered little-endian values, edge
    chunks at full size, so row ``i`` is ``row_bytes`` at offset ``(i % chunk) * row_bytes`` of
    file ``c/<i // chunk>/0/0``: one ``pread``. A chunk zarr never wrote (every value the fill
    value 0: zarr skips empty chunks) reads as zeros. Other layouts go through zarr.

    Writes take the same shortcut: a batch starts at a chunk boundary and fills the chunk (the
    last one is padded with the fill value, as zarr stores edge chunks), so it is written as
    the chunk file's bytes, without zarr's codec pipeline and event loop (zarr's API took 1.3x
    as long for 25 MiB chunks). A write cut short leaves a short file, which a resume writes again.
    """

    def __init__(self, folder: str, name: str, array: Any) -> None:
        self.array = array
        self.chunk = array.chunks[0]
        self.shape = tuple(array.shape[1:])
        self.dtype = np.dtype(array.dtype).newbyteorder("<")
        self.row_bytes = int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize
        self.raw = _is_raw(array)
        self.files = os.path.join(folder, name, "c")
        self.tail = "/0" * len(self.shape)

    def write(self, start: int, rows: np.ndarray) -> None:
        """Rows ``start:start + len(rows)``, ``start`` a chunk boundary, ``rows`` a whole chunk
        or the last one."""
        if not self.raw:
            self.array[start : start + len(rows)] = rows
            return
        chunk = start // self.chunk
        if start % self.chunk or (
            len(rows) != self.chunk and start + len(rows) != self.array.shape[0]
        ):
            raise ValueError(f"rows {start}:{start + len(rows)} are not chunk {chunk}")
        if len(rows) == self.chunk:
            data = np.ascontiguousarray(rows, self.dtype)
        else:
            data = np.zeros((self.chunk, *self.shape), self.dtype)
            data[: len(rows)] = rows
        path = f"{self.files}/{chunk}{self.tail}"
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(memoryview(data).cast("B"))

    def read(self, index: int) -> np.ndarray:
        if not self.raw:
            return np.asarray(self.array[index])
        chunk, offset = divmod(index, self.chunk)
        row = np.empty(self.shape, self.dtype)
        try:
            with open(f"{self.files}/{chunk}{self.tail}", "rb", buffering=0) as f:
                got = os.preadv(
                    f.fileno(), [row.reshape(-1).view(np.uint8)], offset * self.row_bytes
                )
        except FileNotFoundError:
            row[...] = 0
            got = self.row_bytes
        if got != self.row_bytes:
            raise OSError(f"{self.files}/{chunk}{self.tail} is truncated; convert the shard again")
        return row.astype(self.dtype.newbyteorder("="), copy=False)


def _is_raw(array: Any) -> bool:
    """An array of the layout :class:`ChunkRows` reads: bytes codec only, "/" chunk keys."""
    meta = array.metadata.to_dict()
    codecs = [c.get("name") for c in meta.get("codecs", [])]
    encoding = meta.get("chunk_key_encoding", {})
    return (
        codecs == ["bytes"]
        and encoding.get("name") == "default"
        and encoding.get("configuration", {}).get("separator", "/") == "/"
    )
