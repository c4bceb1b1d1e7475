"""embedpipe: take a model's embedding table out of accelerator memory.

The table lives on disk as a chunked zarr array (:class:`Table`); see the README and ``docs/``.
"""

__version__ = "0.1.0"

from . import errors
from .table import Table
from .tensorfiles import export_table, import_table

__all__ = ["Table", "errors", "export_table", "import_table"]
