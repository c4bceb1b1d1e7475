"""embedpipe: take a model's embedding table out of accelerator memory.

The table lives on disk as a chunked zarr array (:class:`Table`); :class:`EmbeddingPipe` looks
rows up inside the DataLoader through one shared cache and trains them with a sparse optimizer
(:mod:`embedpipe.optim`). See the README and ``docs/``.
"""

__version__ = "0.1.0"

from . import errors, hf, optim
from .pipe.handle import EmbeddingPipe
from .store.table import Table
from .store.transfer import export_table, import_table
from .tools.convert import convert
from .tools.converted import ConvertedShard
from .worker import collate
from .worker.batch import EmbeddedBatch

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
