"""The exceptions embedpipe raises.

Every class subclasses the builtin it means, so ``except ValueError`` keeps working for callers
that do not know embedpipe::

    EmbedpipeError                                  base of everything below
    ├── TableNotFoundError      FileNotFoundError   no table at the path
    ├── TableExistsError        FileExistsError     create() over an existing path
    ├── TableFormatError        ValueError          the path is not an embedpipe table
    ├── TableLockedError        RuntimeError        a second writer opened the table
    │   └── TableOwnedError                         the table belongs to a live EmbeddingPipe
    ├── CorruptTableError       OSError             a chunk file missing, truncated or unreadable
    ├── ReadOnlyTableError      PermissionError     write to a table opened with mode="r"
    ├── InvalidIdsError         ValueError, TypeError   float, ragged or non-integer ids
    │   └── IdOutOfRangeError   ValueError, IndexError  id < 0 or id >= num_rows
    ├── InvalidRowsError        ValueError, TypeError   rows of the wrong shape or dtype
    ├── NonFiniteGradientError  FloatingPointError  a NaN or inf in an embedding gradient
    ├── WritebackError          RuntimeError        the writeback thread failed (the cause is attached)
    ├── TableWriteError         OSError             writing the table failed (disk full, I/O error):
    │                                               names the table, the step and the file
    ├── WorkerDiedError         RuntimeError        a DataLoader worker died mid-epoch
    ├── DistributedNotSupportedError  RuntimeError  a pattern a sharded pipe cannot make exact
    ├── ShardMismatchError      RuntimeError        ranks of a sharded table out of step
    ├── PeerLostError           ConnectionError     a rank of a sharded table died or hangs
    ├── SourceFormatError       ValueError          a file `embedpipe import` cannot read
    ├── SourceKeyError          LookupError         no tensor, or several, match the key
    ├── ShardFormatError        ValueError          a shard `embedpipe convert` cannot read
    ├── ConversionExistsError   FileExistsError     convert's output exists and cannot be resumed
    └── IncompleteConversionError  ValueError       a conversion that never finished

Messages name the offending value and say what to do about it.
"""

from __future__ import annotations


class EmbedpipeError(Exception):
    """Base class of every error embedpipe raises on purpose."""


class TableNotFoundError(EmbedpipeError, FileNotFoundError):
    """There is no table at the given path."""


class TableExistsError(EmbedpipeError, FileExistsError):
    """A table (or another file) already exists where a new table was to be created."""


class TableFormatError(EmbedpipeError, ValueError):
    """The path exists but does not hold an embedpipe table of a format this version reads."""


class TableLockedError(EmbedpipeError, RuntimeError):
    """Another process (or another handle in this one) holds the table open for writing."""


class TableOwnedError(TableLockedError):
    """The table object is claimed by a live :class:`~embedpipe.EmbeddingPipe`; only it writes."""


class CorruptTableError(EmbedpipeError, OSError):
    """A chunk file of the table is missing, has the wrong size or cannot be decoded."""


class ReadOnlyTableError(EmbedpipeError, PermissionError):
    """A write was attempted through a handle opened with ``mode="r"``."""


class InvalidIdsError(EmbedpipeError, ValueError, TypeError):
    """Ids that are not an integer array: floats, booleans, ragged lists."""


class IdOutOfRangeError(InvalidIdsError, IndexError):
    """An id below 0 or at or above the table's ``num_rows``."""


class InvalidRowsError(EmbedpipeError, ValueError, TypeError):
    """Rows whose shape or dtype does not match the ids and the table."""


class NonFiniteGradientError(EmbedpipeError, FloatingPointError):
    """An embedding gradient holds NaN or inf; nothing of that step was applied."""


class WritebackError(EmbedpipeError, RuntimeError):
    """The writeback thread failed; the message says at which step, the cause is chained."""


class TableWriteError(EmbedpipeError, OSError):
    """Writing the table failed (full disk, I/O error); ``errno`` is the cause's. The message
    names the table, the step and the file, and says which checkpoint the table reopens at."""


class WorkerDiedError(EmbedpipeError, RuntimeError):
    """A DataLoader worker process died (killed, crashed) while loading batches."""


class OwnerDiedError(EmbedpipeError, RuntimeError):
    """The owner process of a pipe's table died; the table reopens at its last checkpoint."""


class ServiceNotFoundError(EmbedpipeError, ConnectionError):
    """No table service (``embedpipe serve``) listens at the address a pipe was given."""


class DistributedNotSupportedError(EmbedpipeError, RuntimeError):
    """Something a pipe sharded over the ranks of a process group cannot do exactly."""


class ShardMismatchError(EmbedpipeError, RuntimeError):
    """The ranks of a sharded table disagree: they do different things at an exchange (one
    reads a batch while another steps), are at different steps, or one failed what the others
    did (a checkpoint's write). Raised on every rank."""


class PeerLostError(EmbedpipeError, ConnectionError):
    """A rank of a sharded table died or stopped answering; raised on the ranks still alive."""


class SourceFormatError(EmbedpipeError, ValueError):
    """A file that cannot be imported: unknown suffix, unreadable, wrong rank or dtype."""


class SourceKeyError(EmbedpipeError, LookupError):
    """No tensor in the source matches, or several do and ``--key`` must choose."""

    def __str__(self) -> str:  # LookupError's KeyError cousin quotes the message; keep it plain
        return str(self.args[0]) if self.args else ""


class ShardFormatError(EmbedpipeError, ValueError):
    """A corpus shard ``embedpipe convert`` cannot read: unknown suffix, unreadable, wrong
    dtype or shape, a missing ids field, rows longer than ``--max-length``."""


class ConversionExistsError(EmbedpipeError, FileExistsError):
    """The output of a conversion exists and is not a half-done conversion of the same shard,
    table and options (or ``--resume`` was not given)."""


class IncompleteConversionError(EmbedpipeError, ValueError):
    """A converted shard whose conversion never finished (killed or failed); ``--resume`` it."""


class EmbeddingsOffloadedError(EmbedpipeError, RuntimeError, AttributeError):
    """The model's word embeddings were offloaded; it takes ``inputs_embeds``, not ``input_ids``.

    Also an ``AttributeError``, so ``hasattr(model.get_input_embeddings(), "weight")`` is False.
    """
