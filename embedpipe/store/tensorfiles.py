"""Reading the embedding tensor out of the files models ship in.

:func:`open_source` finds the 2-D tensor in a ``.safetensors`` file, a ``.pt``/``.bin`` state
dict, a ``.npy`` array or a Hugging Face model folder (by a word-embedding name, or ``key``) and
returns it as :class:`TensorRows`, read a block of rows at a time, never whole. Writing a table
into those files and back (:func:`~embedpipe.store.transfer.import_table`,
:func:`~embedpipe.store.transfer.export_table`) is in ``transfer.py``.
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

from ..errors import SourceFormatError, SourceKeyError

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

#: The safetensors dtype names of the dtypes a table stores.
SAFETENSORS_DTYPES = {"float32": "F32", "float16": "F16", "float64": "F64"}
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
        if not dtype.is_floating_point:
            raise SourceFormatError(
                f"{origin}: tensor {key!r} is {str(dtype).removeprefix('torch.')}, not floating "
                "point: an embedding table holds floats; pick another with --key"
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
        out = block.to(getattr(torch, self.dtype.name))
        narrower = torch.finfo(out.dtype).max < torch.finfo(block.dtype).max
        if narrower and not bool(out.isfinite().all()) and bool(block.isfinite().all()):
            raise ValueError(
                f"{self.key!r}: rows {start}-{stop} hold values beyond {self.dtype.name}'s "
                f"range ({torch.finfo(out.dtype).max:g}): import them as float32"
            )
        return out.numpy()


def open_source(
    src: str | os.PathLike[str], key: str | None = None, dtype: str | None = None
) -> TensorRows:
    """Find the embedding tensor in ``src`` (see :data:`WORD_EMBEDDING_NAMES`) or the one at ``key``."""
    path = Path(src).expanduser()
    if not path.exists():
        raise FileNotFoundError(
            f"{path} does not exist; give a .safetensors, .pt, .bin or .npy file or a model folder"
        )
    if dtype is not None and dtype not in SAFETENSORS_DTYPES:
        raise ValueError(f"dtype must be one of {sorted(SAFETENSORS_DTYPES)}, got {dtype!r}")
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
    if tensor.layout != torch.strided:
        raise SourceFormatError(
            f"{path}: tensor {name!r} is {str(tensor.layout).removeprefix('torch.')}, not dense: "
            "save its .to_dense() (an embedding table holds every row)"
        )
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
