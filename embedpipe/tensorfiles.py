"""Move a table between embedpipe and the files models ship in.

:func:`import_table` reads one 2-D tensor from a ``.safetensors`` file, a ``.pt``/``.bin`` state
dict, a ``.npy`` array or a Hugging Face model folder and writes it into a new :class:`Table`;
:func:`export_table` writes a table's weights to ``.safetensors`` or ``.npy``. Both stream one
block of chunks at a time, so a table larger than memory moves through a few MiB of it, and both
keep the bits: a float32 table exported is byte-for-byte the tensor that was imported.
"""

from __future__ import annotations

import json
import os
import pickle
import re
import struct
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from .errors import (
    CorruptTableError,
    SourceFormatError,
    SourceKeyError,
    TableExistsError,
    TableFormatError,
    TableLockedError,
)
from .table import Table

#: Names of the word-embedding tensor in common architectures (matched as a key's suffix).
WORD_EMBEDDING_NAMES = (
    "word_embeddings.weight",  # BERT, RoBERTa, XLM-R, ELECTRA, DistilBERT
    "embed_tokens.weight",  # LLaMA, Mistral, Qwen, OPT, BART, T5 encoder/decoder
    "wte.weight",  # GPT-2
    "tok_embeddings.weight",  # Meta's LLaMA checkpoints
    "embed_in.weight",  # GPT-NeoX, Pythia
    "shared.weight",  # T5
    "word_embedding.weight",
    "token_embedding.weight",  # CLIP text
)

_SAFETENSORS_DTYPES = {"float32": "F32", "float16": "F16", "float64": "F64"}
_TORCH_TO_NUMPY = {torch.float32: "float32", torch.float16: "float16", torch.float64: "float64"}
#: Fields every tensor entry of a safetensors header has.
_TENSOR_FIELDS = {"dtype", "shape", "data_offsets"}


class TensorRows:
    """A 2-D tensor in a file, read a block of rows at a time as numpy.

    ``read(start, stop)`` returns rows ``start:stop``; ``dtype`` is the numpy dtype they come out
    in (after the optional cast).
    """

    def __init__(
        self,
        key: str,
        shape: tuple[int, ...],
        dtype: torch.dtype,
        read: Callable[[int, int], torch.Tensor],
        cast: str | None = None,
        origin: str = "",
    ) -> None:
        if len(shape) != 2:
            raise SourceFormatError(
                f"{origin}: tensor {key!r} has shape {list(shape)}; an embedding table is 2-D "
                "[num_rows, dim]: pick another with --key"
            )
        if cast is None and dtype not in _TORCH_TO_NUMPY:
            raise SourceFormatError(
                f"{origin}: tensor {key!r} is {str(dtype).removeprefix('torch.')}, which a table "
                "cannot store as is; pass --dtype float32 (lossless for bfloat16)"
            )
        self.key = key
        self.shape = (int(shape[0]), int(shape[1]))
        self.dtype = np.dtype(cast or _TORCH_TO_NUMPY[dtype])
        self._read = read

    def __getitem__(self, rows: slice) -> np.ndarray:
        start, stop, _ = rows.indices(self.shape[0])
        block = self._read(start, stop)
        return block.to(getattr(torch, self.dtype.name)).numpy()


def open_source(
    src: str | os.PathLike[str], key: str | None = None, dtype: str | None = None
) -> TensorRows:
    """Find the embedding tensor in ``src`` (see :data:`WORD_EMBEDDING_NAMES`) or the one at ``key``."""
    path = Path(src).expanduser()
    if not path.exists():
        raise FileNotFoundError(
            f"{path} does not exist; give a .safetensors, .pt, .bin or .npy file or a model folder"
        )
    if dtype is not None and dtype not in _SAFETENSORS_DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_SAFETENSORS_DTYPES)}, got {dtype!r}")
    if path.is_dir():
        return _open_model_folder(path, key, dtype)
    suffix = path.suffix.lower()
    if suffix == ".safetensors":
        return _open_safetensors({k: path for k in _safetensors_keys(path)}, key, dtype, str(path))
    if suffix in (".pt", ".pth", ".bin"):
        return _open_state_dict(path, key, dtype)
    if suffix == ".npy":
        if key is not None:
            raise SourceKeyError(f"{path}: a .npy file holds one unnamed array; drop --key {key}")
        array = _load_npy(path)
        if array.dtype.kind != "f":
            raise SourceFormatError(f"{path}: array dtype {array.dtype} is not floating point")
        tensor = torch.from_numpy(np.empty(0, array.dtype))
        return TensorRows(
            path.stem,
            array.shape,
            tensor.dtype,
            lambda a, b: torch.from_numpy(np.array(array[a:b])),
            dtype,
            str(path),
        )
    raise SourceFormatError(
        f"{path}: unknown file type {suffix or '(no suffix)'!r}; embedpipe imports .safetensors, "
        ".pt/.pth/.bin state dicts, .npy arrays and Hugging Face model folders"
    )


def import_table(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    *,
    key: str | None = None,
    dtype: str | None = None,
    chunk_rows: int | None = None,
    compressor: str = "none",
    overwrite: bool = False,
    progress: bool = False,
) -> Table:
    """Create the table ``dst`` from the embedding tensor in ``src``; returns it open for writing.

    ``key`` names the tensor (default: the one word-embedding name found); ``dtype`` casts it
    (needed for bfloat16). The source key is recorded in the table's metadata, and a model
    folder's ``pad_token_id`` (``config.json``) as the table's ``padding_idx``, the default of a
    pipe on it.
    """
    source = open_source(src, key, dtype)
    if chunk_rows is not None and (
        not isinstance(chunk_rows, (int, np.integer))
        or isinstance(chunk_rows, bool)
        or chunk_rows < 1
    ):
        raise ValueError(
            f"chunk_rows must be a positive integer, got {chunk_rows!r} (--chunk-rows on the "
            "command line)"
        )
    out = Path(dst).expanduser()
    blocker = _file_above(out)
    if blocker is not None:
        raise TableExistsError(
            f"{out}: cannot make a table folder there, {blocker} is a file; pick another destination"
        )
    existed = out.exists()
    try:
        table = Table.from_tensor(
            out,
            source,
            chunk_rows=chunk_rows,
            compressor=compressor,
            overwrite=overwrite,
            progress=progress,
        )
    except TableFormatError:  # overwrite=True over something that is not a table: never deleted
        if not (overwrite and existed):
            raise
        raise TableExistsError(
            f"{out} exists and is not an embedpipe table; overwrite=True (--force on the command "
            "line) replaces only a table: remove it yourself or pick another destination"
        ) from None
    except TableLockedError:
        raise TableLockedError(
            f"{out} is open for writing by another process or handle; overwrite=True (--force on "
            "the command line) never replaces a table in use: close it there first or pick "
            "another destination"
        ) from None
    table.update_metadata(source={"path": str(Path(src).expanduser().resolve()), "key": source.key})
    pad = _pad_token_id(Path(src).expanduser(), table.num_rows)
    if pad is not None:  # the pipe's default padding_idx, as offload() records it
        table._update_metadata(padding_idx=pad)
    return table


def _pad_token_id(src: Path, num_rows: int) -> int | None:
    """The ``pad_token_id`` of a model folder's ``config.json`` (of the folder the weights file
    is in), if it names a row of the table."""
    config = (src if src.is_dir() else src.parent) / "config.json"
    try:
        pad = json.loads(config.read_text()).get("pad_token_id")
    except (OSError, ValueError, AttributeError):
        return None
    return pad if isinstance(pad, int) and 0 <= pad < num_rows else None


def export_table(
    src: str | os.PathLike[str] | Table,
    dst: str | os.PathLike[str],
    *,
    key: str = "weight",
    overwrite: bool = False,
    progress: bool = False,
) -> Path:
    """Write the weights of table ``src`` to ``dst``: ``.safetensors`` (one tensor at ``key``) or ``.npy``.

    The file appears under its name only once it is complete.
    """
    table = src if isinstance(src, Table) else Table.open(src, "r")
    out = Path(dst).expanduser()
    suffix = out.suffix.lower()
    if suffix not in (".safetensors", ".npy"):
        raise SourceFormatError(
            f"{out}: export writes .safetensors or .npy, not {suffix or '(no suffix)'!r}"
        )
    if out.is_dir():
        raise FileExistsError(f"{out} is a folder; give a file name ending in .safetensors or .npy")
    if out.exists() and not overwrite:
        raise FileExistsError(
            f"{out} already exists; choose another name or pass overwrite=True (--force on the "
            "command line)"
        )
    if not out.parent.is_dir():
        what = "is a file, not a folder" if out.parent.exists() else "does not exist"
        raise FileNotFoundError(
            f"{out}: the folder {out.parent} {what}; create it first or pick another destination"
        )
    if Path(table.path) in out.resolve().parents:
        raise FileExistsError(
            f"{out} is inside the table {table.path}; export to a file outside the table's folder"
        )
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    try:
        with tqdm(
            total=table.num_rows, desc="export", unit="row", unit_scale=True, disable=not progress
        ) as bar:
            if suffix == ".safetensors":
                _write_safetensors(table, tmp, key, bar.update)
            else:
                array = np.lib.format.open_memmap(
                    tmp, mode="w+", dtype=table.dtype, shape=(table.num_rows, table.dim)
                )
                start = 0
                for block in table.iter_blocks():
                    array[start : start + len(block)] = block
                    start += len(block)
                    bar.update(len(block))
                array.flush()
                del array
        os.replace(tmp, out)
    except CorruptTableError:
        raise  # the source is damaged: its own message says where
    except OSError as e:  # disk full, no permission: name the destination, not the temporary file
        raise type(e)(f"{out}: export failed ({e.strerror or e})") from None
    finally:
        tmp.unlink(missing_ok=True)
    return out


# --------------------------------------------------------------------------------- internals
def _write_safetensors(
    table: Table, path: Path, key: str, advance: Callable[[int], object]
) -> None:
    """Stream the table into the safetensors layout: u64 header size, JSON header, raw bytes."""
    header = {
        key: _table_entry(table, 0),
        "__metadata__": {"format": "pt", "producer": "embedpipe"},
    }
    with open(path, "wb") as f:
        _write_header(f, header)
        _write_rows(f, table, advance)


def add_table_to_safetensors(path: Path, table: Table, key: str) -> None:
    """Add the table's weights to the safetensors file ``path`` as the tensor ``key``: its
    header and tensors are copied, then the rows streamed after them, into a file that replaces
    ``path`` once complete (a checkpoint's ``model.safetensors`` gets the word embeddings that
    ``from_pretrained`` expects there)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(path, "rb") as f, open(tmp, "wb") as out:
            size = struct.unpack("<Q", f.read(8))[0]
            header = json.loads(f.read(size))
            if key in header:
                raise SourceKeyError(f"{path} already holds a tensor {key!r}")
            tensors = [v for k, v in header.items() if k != "__metadata__"]
            end = max((v["data_offsets"][1] for v in tensors), default=0)
            header[key] = _table_entry(table, end)
            _write_header(out, header)
            f.seek(8 + size)
            left = end
            while left:
                block = f.read(min(left, 16 << 20))
                if not block:
                    raise SourceFormatError(f"{path}: shorter than its header says; save it again")
                out.write(block)
                left -= len(block)
            _write_rows(out, table, lambda n: None)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _table_entry(table: Table, start: int) -> dict[str, Any]:
    nbytes = table.num_rows * table.dim * table.dtype.itemsize
    return {
        "dtype": _SAFETENSORS_DTYPES[table.dtype.name],
        "shape": [table.num_rows, table.dim],
        "data_offsets": [start, start + nbytes],
    }


def _write_header(f: Any, header: dict[str, Any]) -> None:
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned
    f.write(struct.pack("<Q", len(encoded)))
    f.write(encoded)


def _write_rows(f: Any, table: Table, advance: Callable[[int], object]) -> None:
    for block in table.iter_blocks():
        f.write(np.ascontiguousarray(block, dtype=table.dtype.newbyteorder("<")).data)
        advance(len(block))


def _safetensors_keys(path: Path) -> list[str]:
    """The tensor names in a safetensors file's header, which is checked to describe tensors."""
    try:
        with open(path, "rb") as f:
            head = f.read(8)
            size = struct.unpack("<Q", head)[0] if len(head) == 8 else None
            file_size = os.fstat(f.fileno()).st_size
            if size is None:
                reason = f"{file_size} bytes, shorter than a safetensors header"
            elif size > file_size - 8:
                reason = f"its header claims {size} bytes, the file has {file_size}: damaged?"
            else:
                header = json.loads(f.read(size))
                entries = header.items() if isinstance(header, dict) else [(None, None)]
                if all(
                    k == "__metadata__" or (isinstance(v, dict) and v.keys() >= _TENSOR_FIELDS)
                    for k, v in entries
                ):
                    return [k for k in header if k != "__metadata__"]
                reason = "its header does not describe tensors"
    except OSError as e:
        reason = e.strerror or type(e).__name__
    except ValueError:  # bad JSON or bad UTF-8
        reason = "its header is not JSON"
    raise SourceFormatError(
        f"{path}: not a readable safetensors file ({reason}); download or save it again"
    )


def _open_safetensors(
    files: Mapping[str, Path], key: str | None, dtype: str | None, origin: str
) -> TensorRows:
    try:
        from safetensors import safe_open
    except ImportError:
        raise SourceFormatError(
            "reading .safetensors needs the safetensors package: pip install 'embedpipe[hf]'"
        ) from None
    name = _choose_key(list(files), key, origin)
    file = files[name]
    if not file.is_file():
        raise SourceFormatError(
            f"{origin}: tensor {name!r} is in {file.name}, which is missing; download the whole "
            "checkpoint"
        )
    try:
        handle = safe_open(str(file), framework="pt")
        tensor_slice = handle.get_slice(name)
        head = tensor_slice[:0]
        shape = tuple(tensor_slice.get_shape())
    except Exception as e:  # safetensors' own SafetensorError, or an OSError
        reason = (str(e).strip().splitlines() or [type(e).__name__])[0][:120]
        raise SourceFormatError(
            f"{file}: not a readable safetensors file ({reason}); download or save it again"
        ) from None
    return TensorRows(name, shape, head.dtype, lambda a, b: tensor_slice[a:b], dtype, origin)


def _open_state_dict(path: Path, key: str | None, dtype: str | None) -> TensorRows:
    loaded = _torch_load(path)
    tensors = {path.stem: loaded} if isinstance(loaded, torch.Tensor) else _flatten(loaded)
    if not tensors:
        what = "a dict without tensors" if isinstance(loaded, Mapping) else _type_name(loaded)
        raise SourceFormatError(
            f"{path}: holds no tensors ({what}); save a state dict (model.state_dict()) or a "
            "tensor with torch.save"
        )
    name = _choose_key(list(tensors), key, str(path))
    tensor = tensors[name]
    return TensorRows(
        name, tuple(tensor.shape), tensor.dtype, lambda a, b: tensor[a:b], dtype, str(path)
    )


def _torch_load(path: Path) -> Any:
    """``torch.load`` of tensors only (never arbitrary objects); errors in a line, no torch internals."""
    try:
        try:
            return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError:  # the legacy (non-zip) format cannot be memory-mapped
            return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        found = re.search(r"Unsupported global: GLOBAL ([\w.]+)", str(e))
        if found:
            raise SourceFormatError(
                f"{path}: holds a pickled {found.group(1)} object, not a state dict or a tensor "
                "(embedpipe loads tensors only, never pickled objects); save the weights with "
                "torch.save(model.state_dict(), ...) and import that file"
            ) from None
        reason = "neither a zip archive nor a pickle written by torch.save"
    except EOFError:
        reason = "the file ends early: truncated?"
    except OSError as e:
        reason = e.strerror or type(e).__name__
    except Exception as e:  # torch's messages carry miniz codes and C++ file:line; keep none
        if "PytorchStreamReader" in str(e):
            reason = "a damaged zip archive"
        elif "EOF" in str(e):
            reason = "the file ends early: truncated?"
        else:
            reason = "damaged contents"
    raise SourceFormatError(
        f"{path}: not a readable PyTorch file (torch.load could not read it: {reason}); "
        "download it again or save it again with torch.save"
    )


def _load_npy(path: Path) -> np.ndarray:
    """The array in a .npy file, memory-mapped; errors name the file and never suggest pickle."""
    try:
        with open(path, "rb") as f:
            magic = f.read(6)
    except OSError as e:
        raise SourceFormatError(
            f"{path}: cannot read it ({e.strerror or type(e).__name__})"
        ) from None
    if magic != b"\x93NUMPY":
        raise SourceFormatError(
            f"{path}: not a .npy array file (no .npy header); save the array with numpy.save, or "
            "give the file the suffix of its real format"
        )
    try:
        return np.load(path, mmap_mode="r")
    except (ValueError, OSError) as e:
        reason = (
            "it holds Python objects, not numbers"
            if "objects" in str(e) or "pickle" in str(e)
            else "its header or its size is damaged: truncated?"
        )
        raise SourceFormatError(
            f"{path}: not a readable .npy array file ({reason}); save the array again with "
            "numpy.save"
        ) from None


def _open_model_folder(folder: Path, key: str | None, dtype: str | None) -> TensorRows:
    for index_name in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
        index = folder / index_name
        if index.exists():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
                if not isinstance(weight_map, dict):
                    raise TypeError
            except (OSError, ValueError, KeyError, TypeError):
                raise SourceFormatError(
                    f'{index}: not a readable checkpoint index (no JSON "weight_map" of tensor '
                    "names to files); download it again or point at a weights file"
                ) from None
            if index_name.startswith("model.safetensors"):
                return _open_safetensors(
                    {k: folder / f for k, f in weight_map.items()}, key, dtype, str(folder)
                )
            name = _choose_key(list(weight_map), key, str(folder))
            return _open_state_dict(folder / weight_map[name], name, dtype)
    if (folder / "model.safetensors").exists():
        file = folder / "model.safetensors"
        return _open_safetensors(
            {k: file for k in _safetensors_keys(file)}, key, dtype, str(folder)
        )
    for name in ("pytorch_model.bin", "model.pt", "model.bin"):
        if (folder / name).exists():
            return _open_state_dict(folder / name, key, dtype)
    raise SourceFormatError(
        f"{folder}: no model.safetensors, pytorch_model.bin or sharded index in this folder; "
        "point at the weights file itself"
    )


def _flatten(tree: Any, prefix: str = "") -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    if isinstance(tree, Mapping):
        for k, v in tree.items():
            if isinstance(v, torch.Tensor):
                out[prefix + str(k)] = v
            elif isinstance(v, Mapping):
                out.update(_flatten(v, f"{prefix}{k}."))
    return out


def _choose_key(keys: list[str], key: str | None, origin: str) -> str:
    if key is not None:
        if key in keys:
            return key
        close = [k for k in keys if key in k]
        raise SourceKeyError(
            f"{origin}: no tensor named {key!r}; choose one with --key from: "
            f"{_some(close + [k for k in keys if k not in close])}"
        )
    pattern = re.compile(r"(^|\.)(" + "|".join(re.escape(n) for n in WORD_EMBEDDING_NAMES) + r")$")
    found = [k for k in keys if pattern.search(k)]
    if len(found) == 1:
        return found[0]
    if found:
        raise SourceKeyError(
            f"{origin}: several word-embedding tensors ({', '.join(found)}); choose one with --key"
        )
    raise SourceKeyError(
        f"{origin}: no word-embedding tensor found by name; choose one with --key from: "
        f"{_some(keys)}"
    )


def _some(names: list[str], most: int = 10) -> str:
    """Up to ``most`` names, comma-separated, and how many more there are."""
    shown = ", ".join(names[:most]) or "(none)"
    return shown + (f" and {len(names) - most} more" if len(names) > most else "")


def _type_name(value: Any) -> str:
    kind = type(value)
    return (
        kind.__name__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"
    )


def _file_above(path: Path) -> Path | None:
    """The first existing ancestor of ``path`` when it is a file (no folder can be made under it)."""
    for parent in path.absolute().parents:
        if parent.exists():
            return None if parent.is_dir() else parent
    return None
