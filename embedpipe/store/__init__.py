"""The table on disk, the lowest layer: what every process reads and only the owner writes.

- ``table.py``: :class:`Table`, a zarr group of row chunks with the optimizer's state beside them;
- ``layout.py``: the table's folder and format: metadata, making the arrays and the first rows,
  the checkpoint a handle opens, upgrading format 1;
- ``rowstore.py``: raw row reads and writes on the chunk files (copy-on-write);
- ``checkpoints.py``: checkpoint folders of hard links, commit, recovery, snapshots;
- ``lock.py``: the folder's writer lock (one writer);
- ``tensorfiles.py``: reading the embedding tensor out of model files (.safetensors, .pt, .npy,
  a Hugging Face folder);
- ``transfer.py``: a table made from such a file, and written out to .safetensors or .npy.

Imports nothing above it: the cache and everything else come later.
"""

from .table import Table
from .transfer import export_table, import_table

__all__ = ["Table", "export_table", "import_table"]
