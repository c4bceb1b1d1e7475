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
import re
import struct
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from .errors import SourceFormatError, SourceKeyError
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
        array = np.load(path, mmap_mode="r")
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
    (needed for bfloat16). The source key is recorded in the table's metadata.
    """
    source = open_source(src, key, dtype)
    table = Table.from_tensor(
        dst,
        source,
        chunk_rows=chunk_rows,
        compressor=compressor,
        overwrite=overwrite,
        progress=progress,
    )
    table.update_metadata(source={"path": str(Path(src).expanduser().resolve()), "key": source.key})
    return table


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
    if out.exists() and not overwrite:
        raise FileExistsError(
            f"{out} already exists; choose another name or pass --force / overwrite=True"
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
    finally:
        tmp.unlink(missing_ok=True)
    return out


# --------------------------------------------------------------------------------- internals
def _write_safetensors(
    table: Table, path: Path, key: str, advance: Callable[[int], object]
) -> None:
    """Stream the table into the safetensors layout: u64 header size, JSON header, raw bytes."""
    nbytes = table.num_rows * table.dim * table.dtype.itemsize
    header = {
        key: {
            "dtype": _SAFETENSORS_DTYPES[table.dtype.name],
            "shape": [table.num_rows, table.dim],
            "data_offsets": [0, nbytes],
        },
        "__metadata__": {"format": "pt", "producer": "embedpipe"},
    }
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(encoded)))
        f.write(encoded)
        for block in table.iter_blocks():
            f.write(np.ascontiguousarray(block, dtype=table.dtype.newbyteorder("<")).data)
            advance(len(block))


def _safetensors_keys(path: Path) -> list[str]:
    try:
        with open(path, "rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            return [k for k in json.loads(f.read(size)) if k != "__metadata__"]
    except (OSError, struct.error, ValueError) as e:
        raise SourceFormatError(f"{path}: not a readable safetensors file ({e})") from None


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
    handle = safe_open(str(files[name]), framework="pt")
    tensor_slice = handle.get_slice(name)
    head = tensor_slice[:0]
    return TensorRows(
        name,
        tuple(tensor_slice.get_shape()),
        head.dtype,
        lambda a, b: tensor_slice[a:b],
        dtype,
        origin,
    )


def _open_state_dict(path: Path, key: str | None, dtype: str | None) -> TensorRows:
    try:
        try:
            loaded = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError:  # the legacy (non-zip) format cannot be memory-mapped
            loaded = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise SourceFormatError(
            f"{path}: torch.load could not read it as a state dict ({e})"
        ) from None
    tensors = {path.stem: loaded} if isinstance(loaded, torch.Tensor) else _flatten(loaded)
    if not tensors:
        raise SourceFormatError(f"{path}: holds no tensors")
    name = _choose_key(list(tensors), key, str(path))
    tensor = tensors[name]
    return TensorRows(
        name, tuple(tensor.shape), tensor.dtype, lambda a, b: tensor[a:b], dtype, str(path)
    )


def _open_model_folder(folder: Path, key: str | None, dtype: str | None) -> TensorRows:
    for index_name in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
        index = folder / index_name
        if index.exists():
            weight_map = json.loads(index.read_text())["weight_map"]
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
        close = [k for k in keys if key in k][:10]
        hint = f"; keys containing it: {', '.join(close)}" if close else ""
        raise SourceKeyError(f"{origin}: no tensor named {key!r}{hint}")
    pattern = re.compile(r"(^|\.)(" + "|".join(re.escape(n) for n in WORD_EMBEDDING_NAMES) + r")$")
    found = [k for k in keys if pattern.search(k)]
    if len(found) == 1:
        return found[0]
    if found:
        raise SourceKeyError(
            f"{origin}: several word-embedding tensors ({', '.join(found)}); choose one with --key"
        )
    shown = ", ".join(keys[:10]) + (f" and {len(keys) - 10} more" if len(keys) > 10 else "")
    raise SourceKeyError(
        f"{origin}: no word-embedding tensor found by name; choose one with --key from: {shown}"
    )
