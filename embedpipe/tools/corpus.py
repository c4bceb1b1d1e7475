"""The corpus shard readers :func:`~embedpipe.tools.convert.convert` reads, each a map-style
Dataset of samples: :class:`NpyShard` (a ``.npy`` [N, L] of ids), :class:`JsonlShard` (one JSON
object a line), :class:`ArrowShard` (a Parquet file or a ``datasets`` folder) and
:func:`open_shard`, which picks one by the path's suffix. Each reader's ``scan()`` measures the
shard (its longest and shortest ids rows) and the kind of each field (``_kind``, ``LIST_KINDS``).
"""

from __future__ import annotations

import bisect
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from ..errors import ShardFormatError

SUFFIXES = (".npy", ".jsonl", ".parquet")


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
