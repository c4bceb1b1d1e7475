"""The table as a service: its owner in a process of its own.

- ``channel.py``: :class:`Channel`, messages, raw arrays and descriptors over a Unix socket;
- ``server.py``: the owner process (its ``main``, started by ``reach.py``), serving one
  training process;
- ``client.py``: :class:`RemoteOwner`, the training process's side, which the pipe uses in the
  place of an in-process owner (``EmbeddingPipe(..., owner="process")``, and ``"auto"`` where
  the cache holds less than the table);
- ``serve.py``: :class:`Service`, an owner that outlives the jobs it serves
  (``embedpipe serve TABLE``, ``EmbeddingPipe(..., owner="unix:PATH")``);
- ``address.py``: a service's address (``unix:PATH``), its default, listening there;
- ``shard.py``: the shard of a table a service serves (``embedpipe serve --shard i/S``);
- ``reach.py``: starting an owner process, or connecting to a service;
- ``zygote.py``: a process that forks the owner processes of a training process, having
  imported their modules once;
- ``job.py`` and ``rank.py``: one owner process (or service) shared by the ranks of a
  ``torchrun`` job on one machine, its side and each rank's.
"""

from .address import default_address
from .channel import Channel, ChannelClosed
from .client import RemoteOwner
from .serve import Service

__all__ = ["Channel", "ChannelClosed", "RemoteOwner", "Service", "default_address"]
