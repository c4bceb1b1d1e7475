"""EmbeddingPipe: the user's handle on an offloaded embedding table.

The pipe checks its options, claims the table (one owner per table: a second pipe on the same
``Table`` object, ``table.close()`` or ``table.write()`` under a live pipe raise, naming it), and
hands everything else to its owner: an :class:`~embedpipe.owner.owner.Owner` in the training
process, or a :class:`~embedpipe.service.client.RemoteOwner` for an owner process. A pipe never
closed is closed when it is collected (``unclosed.py``).
"""

from __future__ import annotations

import os
import sys
import weakref
from functools import partial
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from ..cache import budget
from ..cache.policy import DEFAULT_WINDOW, make_policy
from ..errors import DistributedNotSupportedError
from ..optim import RowOptimizer
from ..owner.freshstate import loaded_here
from ..owner.owner import Owner
from ..ranks.shard_owner import ShardOwner, open_shard
from ..ranks.shards import DEFAULT_TIMEOUT, Shards
from ..ranks.shards import process_group as group_of
from ..service.address import is_address
from ..service.client import RemoteOwner
from ..service.rank import RankOwner, open_shared
from ..store.checkpoints import Checkpoint
from ..store.layout import check_compatible, refuse_another_optimizer, remembered_steps
from ..store.table import Table
from . import defaults
from .derived import watch
from .placeholder import OffloadedEmbedding, finish_embeds, ignore_in_ddp, offloaded_embeddings
from .rowscale import recorded_in_model, recorded_scale
from .rowsource import check_not_trained_here, read_through, trainings, trains
from .unclosed import close as close_pipe
from .unclosed import close_when_collected

CONSISTENCY = ("exact", "bounded")
#: Where the table's owner runs: a thread of the training process, or a process of its own;
#: "auto": a process where the owner has work beside the loop (NOTE [ The default owner ]).
OWNERS = ("auto", "thread", "process")


class EmbeddingPipe:
    """An embedding table on disk, looked up inside the DataLoader and trained by a sparse optimizer.

    Parameters
    ----------
    table:
        A :class:`Table` or its path. A path is opened ``"r+"`` when there is an optimizer.
    cache_rows:
        Rows held in the shared cache: 0 reads every row from disk (lazy loading), ``>= num_rows``
        keeps every row once read. Host memory: ``cache_rows x dim x itemsize`` shared, the same
        again per optimizer state array (owner only), 12 bytes per table row (8 with LRU), and
        the workers' ring (see ``loader``).
    policy:
        ``"lru"``, ``"lfu"``, ``"lookahead"`` or ``"auto"``: lookahead (``embedpipe.cache.policy``),
        LFU if its foresight keeps missing, or for a frozen, local, uncompressed table in half the
        memory available (its misses come from the page cache: ``pipe/defaults.py``).
    lookahead:
        Batches the lookahead policy sees ahead (default 64): a loader over a map-style dataset
        reads the ids of its next batches in a child forked at each epoch's first batch, from
        copies of the sampler and the dataset (each sample fetched twice, once there; nothing
        the program draws or sees changes: ``embedpipe/foresee.py``). 0 turns it off (the
        policy is then LFU), as ``"auto"`` does for a frozen table in memory (see ``policy``).
    optimizer:
        ``embedpipe.optim.SGD``, ``Adagrad`` or ``Adam``; ``None`` keeps the table frozen.
    consistency, max_staleness:
        ``"exact"`` (default): each batch sees every update of the steps before it.
        ``"bounded"``: a batch may miss the last ``max_staleness`` steps' updates, never more.
    padding_idx:
        An id whose row is looked up but never updated, as in ``nn.Embedding`` (it gets no
        gradient); also what the default collate pads ragged ids with. Default ``"table"``: the
        one ``embedpipe.hf.offload`` recorded from the model, if any; ``None``: no padding row.
    check_finite:
        Raise :class:`~embedpipe.errors.NonFiniteGradientError` on a NaN/inf gradient (default).
    keep:
        Checkpoints the table keeps (default: the table's setting, 3 for a new table).
    process_group, timeout:
        A pipe that trains its table inside an initialised ``torch.distributed`` process group
        of more than one rank (``torchrun``), or given ``process_group``, is sharded over its
        ranks: each rank owns a range of rows (its cache, optimizer state and writeback; then
        ``cache_rows`` is per rank) and the ranks exchange rows and gradients (``shards.py``,
        ``docs/scale-out.md``). Every rank must make the pipe. ``timeout``: seconds a rank waits
        for the others before it raises :class:`~embedpipe.errors.PeerLostError`.
    owner:
        Where the table's owner (its cache, optimizer state, writeback and every read and write
        of its files) runs: ``"thread"``, threads of the training process; ``"process"``, a
        process of its own that the pipe starts and stops at ``close()``, so the training
        process keeps only the claim, ``inputs_embeds`` and the gradient (``docs/service.md``);
        ``"auto"`` (default): a process when the cache holds less than the whole table, a
        thread when it holds all of it or the pipe is frozen and does not look ahead (what
        measured faster beside a model, ``docs/service.md``), a thread under a process group.
        Under a process group, ``"process"`` is one owner
        process a machine, shared by the machine's ranks and the owner of the machine's
        shard of the rows (then ``cache_rows`` is per machine). Or the address
        of a table service that outlives the job, ``"unix:PATH"`` (``embedpipe serve TABLE``):
        the pipe connects to it, and ``close()`` leaves it running for the next job.
    """

    def __init__(
        self,
        table: Table | str | os.PathLike[str],
        *,
        cache_rows: int,
        policy: str = "auto",
        optimizer: RowOptimizer | None = None,
        consistency: str = "exact",
        max_staleness: int | None = None,
        padding_idx: int | str | None = "table",
        check_finite: bool = True,
        keep: int | None = None,
        lookahead: int = DEFAULT_WINDOW,
        grad_accumulation: Any = None,
        process_group: Any = None,
        timeout: float = DEFAULT_TIMEOUT,
        owner: str = "auto",
    ) -> None:
        _check_options(cache_rows, consistency, max_staleness, grad_accumulation, keep, lookahead)
        if owner not in OWNERS and not is_address(owner):
            raise ValueError(
                f"owner must be one of {OWNERS} or a service's address 'unix:PATH', got {owner!r}"
            )
        if is_address(owner) and optimizer is None:
            owner = "process"  # frozen: it reads the last checkpoint, which needs no service
        served = is_address(owner)  # (nor waits while the service trains a job)
        shards = None
        if optimizer is not None:
            group = group_of(process_group)
            if group is None:
                _check_one_process()
            else:
                if owner == "auto":  # each rank owns a shard (NOTE [ The default owner ])
                    owner = "thread"
                if owner != "thread" and consistency != "exact":
                    raise DistributedNotSupportedError(
                        f"owner={owner!r} does not serve the ranks of a process group in "
                        "bounded mode yet: use consistency='exact' (one owner for the "
                        "machine's ranks) or owner='thread' (each rank owns a shard of the table)"
                    )
                shards = Shards(group, timeout)
                lookahead = 0  # a rank's loader reads ahead only its own rows: not yet
        shared = shards is not None and owner != "thread"  # one owner process a machine
        if shared:
            shards.by_machine()
            table, owns_table = open_shared(table, shards, served)
            shards.plan(table.num_rows, table.chunk_rows)  # a shard a machine
        elif shards is not None:
            # what must be the same on every rank, or the ranks would train different tables
            same = (consistency, max_staleness, padding_idx, check_finite)
            table, owns_table = open_shard(
                table, shards, optimizer, keep, same, _describe_creator()
            )
        else:
            owns_table = not isinstance(table, Table)
            if owns_table:  # a service holds the lock: this process only reads
                table = Table.open(table, "r+" if optimizer is not None and not served else "r")
            elif optimizer is not None and table.mode != "r+" and not served:
                raise ValueError(
                    f"the pipe updates {table.path}: open it with Table.open(path, mode='r+')"
                )
        try:
            if optimizer is None:
                check_not_trained_here(table.path)
                self._trainings = trainings(table.path)  # (stale once another trains it here)
            if padding_idx == "table":
                padding_idx = table.metadata.get("padding_idx")
            if padding_idx is not None and not 0 <= padding_idx < table.num_rows:
                raise ValueError(f"padding_idx must be in [0, {table.num_rows}), got {padding_idx}")
            lookahead = defaults.window(table, policy, optimizer, lookahead)
            if owner == "auto":
                owner = defaults.owner(table.num_rows, cache_rows, optimizer, policy, lookahead)
            remote = owner != "thread"
            if optimizer is not None and (shards is None or shared):
                table._claim(_describe_creator(), elsewhere=remote)
            try:
                if optimizer is not None and shards is None and not remote:
                    table._prepare(optimizer, keep)
                cache_rows = min(int(cache_rows), table.num_rows)
                if shards is not None:
                    lo, hi = shards.owned
                    cache_rows = min(cache_rows, hi - lo)
                states = len(optimizer.state_init()) if optimizer is not None else 0
                needed = budget.pipe_memory(
                    table.num_rows,
                    table.dim,
                    table.dtype,
                    cache_rows,
                    state_arrays=states,
                    policy=policy if lookahead else "lfu",
                )
                budget.warn_if_too_big(needed["total"], f"EmbeddingPipe(cache_rows={cache_rows:,})")
                options = dict(
                    consistency=consistency,
                    max_staleness=max_staleness,
                    padding_idx=padding_idx,
                    check_finite=check_finite,
                )
                placeholders = offloaded_embeddings(table.path) if optimizer is not None else []
                parameter = next((p.rows for p in placeholders if p.rows is not None), None)
                if remote:  # NOTE [ The owner's process ]
                    make = partial(RankOwner, shards) if shared else RemoteOwner
                    self._owner = make(
                        table,
                        policy=policy,
                        cache_rows=cache_rows,
                        optimizer=optimizer,
                        options=options,
                        keep=keep,
                        description=table._owner or _describe_creator(),
                        parameter=parameter,
                        owns_table=owns_table,
                        address=owner if served else None,
                        lookahead=lookahead,
                    )
                else:
                    make = Owner if shards is None else partial(ShardOwner, shards)
                    self._owner = make(
                        table,
                        make_policy(policy, cache_rows, table.num_rows, lookahead),
                        optimizer,
                        options,
                        owns_table=owns_table,
                        parameter=parameter,
                    )
            except BaseException:
                table._release_claim()
                raise
        except BaseException:
            if owns_table:
                table.close()
            raise
        self.table = table
        # a function of the table, not a method: the owner must not keep the pipe alive
        self._owner.finish_embeds = partial(
            finish_embeds,
            table.path,
            recorded_scale(table.metadata),
            in_model=recorded_in_model(table.metadata),
            reader=weakref.ref(self),
        )
        self.optimizer, self.consistency, self.padding_idx = optimizer, consistency, padding_idx
        if optimizer is not None:  # table.read() sees the pipe's rows
            trains(self)
            table._reads_after(self._owner.before_read)
            for placeholder in placeholders:
                placeholder.attach(self.parameter)
                read_through(placeholder, self)
        self._finalizer = close_when_collected(self, self._owner)

    # ------------------------------------------------------------------------- public
    def loader(
        self,
        dataset: Dataset,
        *,
        batch_size: int | None = 1,
        shuffle: bool = False,
        num_workers: int = 0,
        collate_fn: Any = None,
        ids_key: str = "input_ids",
        ring_rows: int | None = None,
        **dataloader_kwargs: Any,
    ):
        """A DataLoader over ``dataset`` whose batches arrive with ``"inputs_embeds"``.

        Takes the arguments of ``torch.utils.data.DataLoader`` (``prefetch_factor``,
        ``persistent_workers``, ``pin_memory``, ``multiprocessing_context``...). ``collate_fn``
        must return a mapping with the token ids under ``ids_key``. ``ring_rows`` bounds the
        unique ids per batch that travel through shared memory (default ``min(num_rows, 2048)``);
        a batch with more is sent as a tensor, which is correct but slower.
        """
        from .loader import PipeLoader

        self._owner.check_open()
        return PipeLoader(
            self,
            dataset,
            batch_size=batch_size,
            shuffle=shuffle,
            num_workers=num_workers,
            collate_fn=collate_fn,
            ids_key=ids_key,
            ring_rows=ring_rows,
            **dataloader_kwargs,
        )

    @property
    def parameter(self) -> torch.nn.Parameter:
        """The table's pending gradient, as a ``Parameter`` whose ``.grad`` it is (U, D).

        It sits in the model where the embedding was (:meth:`attach`; ``offload`` does it), so
        ``clip_grad_norm_(model.parameters())`` counts and scales it, ``zero_grad`` drops it and
        an optimizer holding it sets the table's learning rate (``embedpipe/gradient.py``).
        A model with no offloaded embedding: add it to your clipping and optimizer yourself.
        """
        if self._owner.gradient is None:
            raise ValueError("a pipe without an optimizer trains nothing and has no parameter")
        return self._owner.gradient.parameter

    def attach(self, model: torch.nn.Module) -> None:
        """Put :attr:`parameter` in ``model``, in the place of its offloaded word embeddings, so
        that clipping and optimizers built from ``model.parameters()`` see the table, and make
        the batches the model's (its dtype, its embedding's scale and hooks).

        Done by itself for models offloaded in this process to the table's path; call it for
        one offloaded to a table this pipe reads a copy of. A frozen pipe puts no parameter in.
        """
        embeddings = getattr(model, "get_input_embeddings", lambda: None)()
        if not isinstance(embeddings, OffloadedEmbedding):
            found = [m for m in model.modules() if isinstance(m, OffloadedEmbedding)]
            if len(found) != 1:
                raise ValueError(
                    f"{type(model).__name__} has {len(found)} offloaded embedding modules; "
                    "offload its word embeddings with embedpipe.hf.offload(model, path) first"
                )
            embeddings = found[0]
        if self.optimizer is not None:  # its rows are this table's (a frozen pipe's are not)
            embeddings.attach(self.parameter)
            embeddings.table_id = self.table._meta.get("id")
        read_through(embeddings, self)  # its rows are this table's: save_pretrained reads them
        embeddings._register(self.table.path)  # batches as it takes them, from a copy too
        ignore_in_ddp(model, embeddings)
        watch(model, embeddings)  # NOTE [ What a model derives from input_ids ]

    def step(self) -> bool:
        """Apply the pending gradient as one table step, at the row optimizer's learning rate.

        For loops that train only the table: with a torch optimizer, its ``step()`` does this
        (``docs/training.md``). Returns False when no gradient was pending.
        """
        self._owner.check_open()
        if self._owner.gradient is None:
            raise ValueError("this pipe has no optimizer: the table is frozen")
        return self._owner.gradient.step()

    def stats(self) -> dict[str, int]:
        """Counters since the pipe opened: hits, misses, rows_read, rows_written, evictions, ..."""
        return self._owner.stats()

    def flush(self) -> None:
        """Apply every queued step and write every updated row and its state to the table's
        arrays (not a checkpoint: a crash still reopens at the last one).

        A gradient no optimizer step has taken yet stays pending (as ``.grad`` does in torch).
        """
        self._owner.flush()

    def checkpoint(self) -> Checkpoint:
        """Apply every queued step and commit the table, its optimizer state and the step as a
        checkpoint: a crash from now on reopens here. Returns the checkpoint (``seq``, ``step``,
        ``path``). The table keeps the last ``keep`` checkpoints (``Table.open(path, step=N)``
        opens an older one). A gradient no step has taken stays pending, as in :meth:`flush`.
        """
        return self._owner.checkpoint()

    def save_checkpoint(self, folder: str | os.PathLike[str]) -> Checkpoint:
        """Commit a checkpoint and copy it into ``folder`` (which must not exist) as a table of
        its own: weights, optimizer state and step, ready to be moved to another machine.

        Files are hard-linked where ``folder`` is on the table's filesystem (no copy: chunks in a
        checkpoint never change), copied elsewhere; ``folder`` appears complete or not at all.
        """
        return self._owner.save(os.path.abspath(os.path.expanduser(folder)))

    def load_checkpoint(self, folder: str | os.PathLike[str]) -> None:
        """Make this pipe's table the snapshot in ``folder`` (made by :meth:`save_checkpoint`, or
        any table of the same shape and row optimizer), at that snapshot's step. The cache is
        emptied, a gradient not yet stepped stays pending (as ``.grad`` stays at a load in
        torch), and the snapshot becomes the table's newest checkpoint."""
        if self.optimizer is None:
            raise ValueError("load_checkpoint needs a pipe that trains the table (an optimizer)")
        source = Table.open(folder, "r")
        check_compatible(self.table, source)
        refuse_another_optimizer(source.metadata, self.optimizer, source.path)
        gradient, remembered = (
            self._owner.gradient,
            remembered_steps(source.metadata, self.optimizer),
        )
        self._owner.load(source)
        gradient.stepped = remembered - gradient.steps  # (NOTE [ A new optimizer and the ...)
        loaded_here(gradient.path)

    def close(self) -> None:
        """Apply what is queued, write every updated row, commit a checkpoint, stop the writeback
        thread and release the table (closed too, if the pipe opened it).

        A gradient that no optimizer step took is not applied, as torch never applies a
        ``.grad`` no step used; a ``RuntimeWarning`` says so.

        If the writeback thread failed, the steps before the failure are still committed (the
        table's ``step`` says which) and the error is raised after that. If writing fails (a
        full disk), the error is raised and ``close()`` can be called again later. A table
        shared by ranks commits nothing with an exception on its way (docs/reliability.md).
        """
        close_pipe(self._owner, self._finalizer, sys.exc_info()[1], True, repr(self))

    def __enter__(self) -> EmbeddingPipe:
        return self

    def __exit__(self, exc_type: object, exc: BaseException | None, *rest: object) -> None:
        raise_errors = exc_type is None  # don't hide the error on its way
        close_pipe(self._owner, self._finalizer, exc, raise_errors, repr(self))

    def __repr__(self) -> str:
        owner = self._owner
        return (
            f"EmbeddingPipe({self.table.path!r}, cache_rows={owner.shared.cache_rows}, "
            f"optimizer={self.optimizer}, consistency={self.consistency!r})"
        )


def _describe_creator() -> str:
    """ "EmbeddingPipe made at file:line (pid P)", the first frame outside embedpipe."""
    package = os.path.dirname(os.path.abspath(__file__))
    frame = sys._getframe(1)
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(package):
        frame = frame.f_back
    where = f"{frame.f_code.co_filename}:{frame.f_lineno}" if frame is not None else "?"
    return f"an EmbeddingPipe made at {where} (pid {os.getpid()})"


def _check_one_process() -> None:
    """A training pipe outside a process group: refused where torchrun started several ranks
    and none made a process group (each would train a copy of the table of its own)."""
    world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    if world > 1:
        rank = os.environ.get("RANK", "?")
        raise DistributedNotSupportedError(
            f"this process is rank {rank} of {world} (WORLD_SIZE={world}: torchrun) and no "
            "torch.distributed process group is initialised, so each rank would train a copy "
            "of the table of its own. Call torch.distributed.init_process_group() before making "
            "the EmbeddingPipe (it is then sharded over the ranks), or run one process"
        )


def _check_options(
    cache_rows: Any,
    consistency: str,
    max_staleness: Any,
    grad_accumulation: Any,
    keep: Any,
    lookahead: Any,
) -> None:
    if (
        not isinstance(cache_rows, (int, np.integer))
        or isinstance(cache_rows, bool)
        or cache_rows < 0
    ):
        raise ValueError(
            f"cache_rows must be an integer >= 0 (0 reads every row from disk), got {cache_rows!r}"
        )
    if consistency not in CONSISTENCY:
        raise ValueError(f"consistency must be one of {CONSISTENCY}, got {consistency!r}")
    if consistency == "bounded" and (not isinstance(max_staleness, int) or max_staleness < 1):
        raise ValueError(
            f"consistency='bounded' needs max_staleness, an integer >= 1, got {max_staleness!r}"
        )
    if consistency == "exact" and max_staleness not in (None, 0):
        raise ValueError(f"max_staleness={max_staleness!r} needs consistency='bounded'")
    if grad_accumulation is not None:
        raise TypeError(
            "EmbeddingPipe(grad_accumulation=...) was removed: the table now steps when your "
            "optimizer steps, so accumulate as you do for the model (several backward() calls, "
            "then optimizer.step()), or with Trainer's gradient_accumulation_steps, Lightning's "
            "accumulate_grad_batches or accelerator.accumulate()"
        )
    if keep is not None and (not isinstance(keep, int) or isinstance(keep, bool) or keep < 1):
        raise ValueError(f"keep must be an integer >= 1 (checkpoints kept), got {keep!r}")
    if not isinstance(lookahead, int) or isinstance(lookahead, bool) or lookahead < 0:
        raise ValueError(
            f"lookahead must be an integer >= 0 (batches seen ahead; 0: off), got {lookahead!r}"
        )
