"""embedpipe: take a model's embedding table out of accelerator memory.

The table lives on disk as a chunked zarr array (:class:`Table`); :class:`EmbeddingPipe` looks
rows up inside the DataLoader through one shared cache and trains them with a sparse optimizer
(:mod:`embedpipe.optim`). See the README and ``docs/``.
"""

__version__ = "0.1.0"

from . import collate, errors, hf, optim
from .batch import EmbeddedBatch
from .convert import ConvertedShard, convert
from .pipe import EmbeddingPipe
from .table import Table
from .tensorfiles import export_table, import_table

__all__ = [
    "ConvertedShard",
    "EmbeddedBatch",
    "EmbeddingPipe",
    "Table",
    "collate",
    "convert",
    "errors",
    "export_table",
    "hf",
    "import_table",
    "optim",
]
