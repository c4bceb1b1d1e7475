"""Tools around the library, the top layer: nothing in the library imports them.

- ``cli.py``: the ``embedpipe`` command (import, export, info, convert, advise, bench);
- ``convert.py``: a corpus shard pre-converted into embeddings (:func:`convert`), read from
  the shard readers of ``corpus.py`` (``.npy``, ``.jsonl``, Parquet, ``datasets`` folders) and
  read back through ``converted.py`` (:class:`ConvertedShard`);
- ``advice.py`` and ``simulate.py``: the miss-ratio curve of a trace and a cache size for a
  memory budget;
- ``benchmark/``: ``embedpipe bench``, the side-by-side benchmark.
"""

from .convert import convert
from .converted import ConvertedShard

__all__ = ["ConvertedShard", "convert"]
