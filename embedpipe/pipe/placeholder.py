"""The offloaded embedding: the module that stands where a model's ``nn.Embedding`` was.

:class:`OffloadedEmbedding` holds no rows; a training pipe's gradient parameter is its one
parameter, so an optimizer and ``clip_grad_norm_`` over ``model.parameters()`` reach the table.
Every one made in this process is registered by its table's path: a pipe on that table adopts
them (``EmbeddingPipe.attach``) and asks them for the dtype ``inputs_embeds`` should have.
``embedpipe.hf.offload`` makes one; ``embedpipe.lightning`` and DDP see it through
:func:`ignore_in_ddp`.
The table's step in its state dicts: NOTE [ A state dict keeps the table's step ] in
``rowsource.py``.
"""

from __future__ import annotations

import functools
import os
import warnings
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from typing import Any

import torch
from torch import nn

from ..errors import EmbeddingsOffloadedError
from .callhooks import Hooked, forward_hooks, has_hooks, take_hooks
from .rowscale import scale_of, scaled, without_weight
from .rowsource import (
    check_not_trained_here,
    check_same_table,
    check_step,
    pipe_step,
    read_like_its_table,
    read_through,
    stamp,
    taken_at,
)

#: The offloaded embedding modules of this process, by table path, oldest first: a pipe on that
#: table adopts the newest one's gradient parameter and attaches it to all of them.
_OFFLOADED: dict[str, list[weakref.ref[OffloadedEmbedding]]] = {}
#: Called whenever a module is made (``embedpipe.hf`` wraps ``save_pretrained``: NOTE
#: [ save_pretrained on an offloaded model ] in ``hf/saving.py``).
ON_MADE: list[Callable[[], None]] = []


@functools.lru_cache(maxsize=64)
def _resolved(path: str) -> str:
    """The registry's key for ``path``; cached: a batch asks for its table's modules at every
    read (their dtype), and ``realpath`` makes a system call per part of the path."""
    return os.path.realpath(path)


def offloaded_embeddings(path: str) -> list[OffloadedEmbedding]:
    """The modules offloaded to the table at ``path`` in this process and still alive, newest
    first (a notebook cell run again offloads a new model over the same path)."""
    refs = _OFFLOADED.get(_resolved(path), [])
    refs[:] = [r for r in refs if r() is not None]
    return [m for m in (r() for r in reversed(refs)) if m is not None]


def finish_embeds(
    path: str,
    recorded: float | torch.Tensor | None,
    embeds: torch.Tensor,
    ids: Callable[[], torch.Tensor],
    *,
    in_model: bool = False,
    reader: Callable[[], Any] | None = None,
) -> torch.Tensor:
    """``embeds`` gathered from the table at ``path`` for the batch's ``ids()`` as the models
    offloaded to it take them (:meth:`OffloadedEmbedding.finish`): in their dtype (a model cast
    after ``offload``: ``model.half()``), times their scale (NOTE [ Scaled word embeddings ] in
    ``rowscale.py``), through the hooks on their embedding (NOTE [ Hooks on the offloaded
    embedding ] in ``callhooks.py``). A placeholder that knows no scale (one built by hand) takes
    the one the table ``recorded`` at ``offload`` (multiplied ``in_model``, or in the module), as
    does a process with no model (``embedpipe convert``). Models on one table that disagree on
    any of these raise: a batch cannot tell which one will read it."""
    pipe = None if reader is None else reader()  # (a weak reference) the pipe reading
    if pipe is not None and pipe.optimizer is None:
        check_not_trained_here(path, pipe._trainings)  # (made before a pipe that trains)
    modules = offloaded_embeddings(path)
    if not modules:
        return embeds if recorded is None else scaled(embeds, recorded)
    if pipe is not None:
        trains = pipe.optimizer is not None
        if trains:  # its table holds their rows (a module made after it too)
            check_same_table(modules[0], pipe.table)  # (a frozen pipe: any table, attached)
            _check_padding(modules[0], pipe)
            _warn_if_cast(modules[0], pipe)
            for module in modules:
                read_through(module, pipe)
                if module.table_id is None:  # built by hand (a resume): its rows are this table's
                    module.table_id = pipe.table._meta.get("id")
            if torch.is_grad_enabled() and _restored_in_training(modules[0]):
                raise EmbeddingsOffloadedError(
                    f"embedpipe.hf.restore put the rows of {path} back in the model, whose "
                    "nn.Embedding no longer follows the table this pipe trains: training on "
                    "would leave it at the rows of then. Restore once training is over; to save "
                    "mid-training, use `with embedpipe.hf.restored(model, pipe):`"
                )
        # the newest module: the one the batch is made for; a frozen pipe's read checks, and
        # leaves the record to the table the model trains on (NOTE [ A state dict keeps the
        # table's step ] in rowsource.py)
        if getattr(modules[0], "_loaded_step", None) is not None:
            modules[0].check_loaded_step(pipe_step(pipe), pipe.table.path, forget=trains)
    table = None if recorded is None else float(recorded)
    scales = {table if m.scale_value is None else m.scale_value for m in modules}
    if table is not None:
        scales.add(table)
    if len(scales) > 1:
        raise EmbeddingsOffloadedError(
            f"the models offloaded to {path} (or the table, which records {table}) disagree on "
            f"the scale of its rows ({sorted(map(str, scales))}): a model whose embedding "
            "scales its rows needs a table of its own"
        )
    dtypes = {m.dtype for m in modules}
    if len(dtypes) > 1:
        raise EmbeddingsOffloadedError(
            f"the models offloaded to {path} take inputs_embeds in different dtypes "
            f"({', '.join(sorted(map(str, dtypes)))}); cast them alike, or delete the old one"
        )
    if len(modules) > 1 and any(has_hooks(m) for m in modules):
        raise EmbeddingsOffloadedError(
            f"{len(modules)} models are offloaded to {path} and hooks are registered on the "
            "word embedding of one of them (NEFTune, enable_input_require_grads): a batch "
            "cannot tell which model will read it; give each model a table of its own, or "
            "delete the models not in use"
        )
    return modules[0].finish(embeds, recorded, ids, in_model=in_model)


def _check_padding(module: OffloadedEmbedding, pipe: Any) -> None:
    """Raise if the row ``module``'s embedding pads with (``nn.Embedding`` gives it no gradient)
    is not the one ``pipe`` leaves out of the table's gradient. A placeholder built by hand
    with none takes the pipe's."""
    mine = module.padding_idx
    if mine is not None and mine < 0:  # counted from the end, as nn.Embedding takes it
        mine += pipe.table.num_rows
    if (mine is not None or module._template is not None) and mine != pipe.padding_idx:
        raise EmbeddingsOffloadedError(
            f"the model's word embedding pads with row {mine} (nn.Embedding gives it no "
            f"gradient) and the pipe training {pipe.table.path} with {pipe.padding_idx} (the "
            "padding_idx the table records, or the pipe's padding_idx=): make the pipe with "
            f"padding_idx={mine}"
        )


def _warn_if_cast(module: OffloadedEmbedding, pipe: Any) -> None:
    """Warn, once a pipe, where a batch read to train takes the rows in another dtype than the
    table trains in: the model was cast after ``offload`` (``model.to(torch.bfloat16)``), and
    an ``nn.Embedding`` cast with it would train in that dtype (found by a probe: 3.2e-4 apart
    after a few bfloat16 steps, silently). It cannot be made exact (zarr stores no bfloat16),
    nor is it wrong to want: mixed precision keeps the table in float32 on purpose."""
    table = pipe.table.dtype.name
    if (
        str(module.dtype).removeprefix("torch.") == table
        or not (torch.is_grad_enabled() and module.training)  # (evaluation: review)
        or not pipe.parameter.requires_grad
        or getattr(pipe, "_warned_cast", False)
    ):
        return
    pipe._warned_cast = True
    warnings.warn(
        f"the model takes inputs_embeds in {module.dtype} (it was cast after offload()), and "
        f"the table trains in {table}, the dtype it is stored in; an nn.Embedding cast with the "
        f"model would train in {module.dtype}, so the two differ by its rounding. To train the "
        "rows in the model's dtype, cast the model before offload() (float16 or float64; zarr "
        "stores no bfloat16); for mixed precision, keep the model in float32 under torch.autocast",
        RuntimeWarning,
        stacklevel=4,
    )


def _restored_in_training(module: OffloadedEmbedding) -> bool:
    """``embedpipe.hf.restore`` put the rows back in a model that still holds them and is in
    training mode (not evaluating, nor given its placeholder back)."""
    refs = getattr(module, "_restored", None)
    model, restored = (None, None) if refs is None else (ref() for ref in refs)
    embeddings = getattr(model, "get_input_embeddings", None)
    return bool(model is not None and model.training and embeddings and embeddings() is restored)


class OffloadedEmbedding(nn.Module):
    """Stands where a model's ``nn.Embedding`` was; holds no rows.

    Keeps ``num_embeddings``, ``embedding_dim``, ``padding_idx`` and the table's ``path``, plus
    the ``dtype`` and ``device`` the model expects ``inputs_embeds`` in (they follow
    ``model.to(...)``). :func:`offload` puts one in a model; a model rebuilt in a new process
    (to resume training on a table that exists) takes one with :meth:`replacing`, or by hand:
    ``model.set_input_embeddings(OffloadedEmbedding(V, D, path, padding_idx=...))``, made before
    the pipe, which then attaches its parameter to it. Calling it, reading ``.weight`` or
    ``copy.deepcopy`` (an EMA, a best-model copy) raises :class:`EmbeddingsOffloadedError`.

    Its one parameter, ``rows``, is a training pipe's :attr:`~embedpipe.EmbeddingPipe.parameter`:
    the table's pending gradient, in the model where the embedding weight was, so clipping
    ``model.parameters()`` counts it. :func:`offload` makes it, and a pipe on the table adopts it,
    so an optimizer built before or after the pipe holds it. It holds no data (a view of one
    zero), is left out of ``state_dict()`` and does not follow ``model.to(...)``: it lives where
    the gradient does.
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        path: str,
        *,
        padding_idx: int | None = None,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        embed_scale: float | torch.Tensor | None = None,
    ) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.path, self.padding_idx = path, padding_idx
        self.dtype, self.device = dtype, torch.device(device)
        self.register_parameter("rows", None)
        #: the scale as a number, to compare (NOTE [ Scaled word embeddings ]); None: no scale
        self.scale_value = None if embed_scale is None else float(embed_scale)
        #: the model's forward multiplies the rows by it, not the embedding (:meth:`scale_in_model`)
        self.in_model = False
        if isinstance(embed_scale, torch.Tensor):  # a buffer, as the scaled module's: follows .to
            self.register_buffer("embed_scale", embed_scale.detach().clone(), persistent=False)
        else:
            self.embed_scale = embed_scale
        # the module it replaced, without its weight (not a submodule: out of .modules())
        object.__setattr__(self, "_template", None)
        #: the table's step a state dict loaded into the model was taken at (NOTE [ A state
        #: dict keeps the table's step ]); None once checked
        self._loaded_step: int | None = None
        #: the id of the table offloaded to (``rowsource.check_same_table``); None: unknown
        self.table_id: str | None = None
        # a pipe made on the table from now on finds it (and attaches its parameter to it)
        self._register(path)
        for made in ON_MADE:
            made()

    def _register(self, path: str) -> None:
        """Found by the pipes on the table at ``path`` (a copy of its own table: ``attach``)."""
        refs = _OFFLOADED.setdefault(_resolved(path), [])
        if not any(r() is self for r in refs):
            refs.append(weakref.ref(self))

    def _unregister(self) -> None:
        """Out of the registry: ``offload`` failed after making it."""
        refs = _OFFLOADED.get(_resolved(self.path), [])
        refs[:] = [r for r in refs if r() is not None and r() is not self]

    @classmethod
    def replacing(cls, module: nn.Module, path: str) -> OffloadedEmbedding:
        """One to stand where ``module`` (a model's word embedding, holding its weight) is, for
        the table at ``path``: its shape, ``padding_idx``, dtype, device and the scale it
        multiplies its rows by (NOTE [ Scaled word embeddings ]); :meth:`restore` gives back a
        module of ``module``'s class. A model rebuilt to resume on an existing table uses it too:
        ``model.set_input_embeddings(OffloadedEmbedding.replacing(model.get_input_embeddings(),
        path))``. Raises :class:`InvalidRowsError` for a module that does more than that."""
        scale = scale_of(module)  # raises for a module that does more than scale its rows
        weight = module.weight
        placeholder = cls(
            *weight.shape,
            path,
            padding_idx=getattr(module, "padding_idx", None),
            dtype=weight.dtype,
            device=weight.device,
            embed_scale=scale,
        )
        object.__setattr__(placeholder, "_template", without_weight(module))
        take_hooks(placeholder, module)  # they run on the batches' rows (callhooks.py)
        placeholder.train(module.training)  # (a hook reads it: NEFTune adds noise in training)
        # the gradient parameter a pipe on the table will adopt (an optimizer built now holds
        # it); a weight frozen before (requires_grad False) leaves the table frozen, as it was
        empty = torch.empty(0, weight.shape[1], device=weight.device)
        placeholder.attach(nn.Parameter(empty, requires_grad=weight.requires_grad))
        return placeholder

    def recorded(self) -> dict[str, Any]:
        """What the table's metadata keeps of the module: its ``padding_idx`` (the pipe's
        default) and its row scale (for a pipe in a process with no model: ``embedpipe
        convert``), as ``rowscale.recorded_scale`` reads it back."""
        metadata: dict[str, Any] = {}
        if self.padding_idx is not None:
            metadata["padding_idx"] = int(self.padding_idx)
        if self.embed_scale is not None:
            buffer = isinstance(self.embed_scale, torch.Tensor)
            metadata["embed_scale"] = {"value": self.scale_value, "buffer": buffer}
            if self.in_model:
                metadata["embed_scale"]["in_model"] = True
        return metadata

    def scale_in_model(self, scale: float) -> None:
        """The model multiplies the looked-up rows by ``scale`` itself (Marian, Pegasus:
        ``embedpipe/hf/probe.py`` found it): its batches' ``inputs_embeds`` carry it."""
        self.embed_scale, self.scale_value = scale, float(scale)
        self.in_model = True

    def finish(
        self,
        embeds: torch.Tensor,
        recorded: float | torch.Tensor | None,
        ids: Callable[[], torch.Tensor],
        *,
        in_model: bool = False,
    ) -> torch.Tensor:
        """``embeds``, the rows gathered for the batch's ``ids()``, as the model computes them
        from the ids: in its dtype, through the hooks registered on this module or on the one it
        replaced, times its scale (or the table's ``recorded`` one, multiplied ``in_model``, if it
        knows none): before the hooks where the embedding scales, after them where the model's
        forward does (NOTE [ Hooks on the offloaded embedding ] in ``callhooks.py``)."""
        gathered = embeds
        if embeds.dtype != self.dtype:
            embeds = embeds.to(self.dtype)
        if self.embed_scale is not None:
            scale, in_model = self.embed_scale, self.in_model
        else:
            scale = recorded
        if scale is None:
            embeds = forward_hooks(self, embeds, ids)
        elif in_model:
            embeds = scaled(forward_hooks(self, embeds, ids), scale)
        else:
            embeds = forward_hooks(self, scaled(embeds, scale), ids)
        if has_hooks(self):  # a second forward pass on this read runs them again (read_once)
            Hooked.on(embeds, partial(self.finish, gathered, recorded, ids, in_model=in_model))
        return embeds

    def restore(self, weight: torch.Tensor, recorded: Any = None) -> nn.Module:
        """The replaced module again (an ``nn.Embedding`` for one made by hand), holding
        ``weight``, on the model's device and in its dtype, trainable as the table was."""
        if self._template is None and (self.embed_scale is not None or recorded is not None):
            raise EmbeddingsOffloadedError(
                "this model's embedding scaled its rows and its placeholder was built by hand: "
                "set the weight of the model's own embedding module (of its class) to the "
                "table's rows (Table.to_tensor()) instead"
            )
        if self._template is None:
            module = nn.Embedding(
                self.num_embeddings, self.embedding_dim, padding_idx=self.padding_idx
            )
        else:
            module = without_weight(self._template)
        trains = self.rows.requires_grad if self.rows is not None else True
        module.weight = nn.Parameter(weight, requires_grad=trains)
        take_hooks(module, self)  # those it had and those registered since (NEFTune...)
        for name, buffer in self._buffers.items():  # as they followed the model's .to()
            if name in module._buffers:
                module._buffers[name] = buffer
        return module.to(device=self.device, dtype=self.dtype)

    def attach(self, parameter: nn.Parameter) -> None:
        """Hold a pipe's gradient parameter as ``rows`` (replacing an earlier pipe's)."""
        self.rows = parameter

    @contextmanager
    def _without_rows(self) -> Iterator[None]:
        rows = self._parameters.pop("rows", None)
        try:
            yield
        finally:
            self._parameters["rows"] = rows

    def _save_to_state_dict(self, destination: dict[str, Any], prefix: str, *args: Any) -> None:
        with self._without_rows():
            super()._save_to_state_dict(destination, prefix, *args)
        stamp(self, destination, prefix)  # NOTE [ A state dict keeps the table's step ]

    def _load_from_state_dict(
        self, state_dict: dict[str, Any], prefix: str, *args: Any, **kwargs: Any
    ) -> None:
        if getattr(self, "_skip_weight", False):  # a checkpoint's copy of the table's rows
            state_dict.pop(prefix + "weight", None)
        taken = taken_at(state_dict, prefix)
        if taken is not None:  # (one without it, a partial load, leaves the record)
            self._loaded_step = taken
        with self._without_rows():
            super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def check_loaded_step(
        self, step: int | None = None, path: str | None = None, *, forget: bool = True
    ) -> None:
        """Raise if a state dict loaded into the model was taken at another step of the table
        than ``step`` (of the table at ``path``; default: ``rowsource.table_step``); once they
        agree, forget it if ``forget`` (NOTE [ A state dict keeps the table's step ] in
        ``rowsource.py``)."""
        if check_step(self, getattr(self, "_loaded_step", None), step, path) and forget:
            self._loaded_step = None

    def check_table(self, table: Any, step: int | None = None) -> None:
        """Raise if ``table`` is not the one this module's rows were offloaded to (made anew at
        its path), or a state dict loaded into the model was taken at another step than
        ``step`` (default: the table's); forgets nothing (a save, a restore)."""
        check_same_table(self, table)
        self.check_loaded_step(table.step if step is None else step, table.path, forget=False)

    def _error(self) -> EmbeddingsOffloadedError:
        return EmbeddingsOffloadedError(
            f"the word embeddings of this model live in {self.path}; call the model with "
            "inputs_embeds=batch['inputs_embeds'] from embedpipe's loader, not input_ids. Given "
            "inputs_embeds, a model still embeds ids of its own where it pads them to its "
            "attention window or block size (Longformer, BigBird: pad the batches to a multiple "
            "of it), looks up token_type_ids in its word embeddings (GPT-2), or generates "
            "(generate() embeds each new token): those cannot run with the table offloaded"
        )

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        raise self._error()

    def __getattr__(self, name: str) -> Any:
        if name == "weight":  # resize_token_embeddings, a weight tied by hand, an init pass
            raise EmbeddingsOffloadedError(
                f"the word embeddings of this model live in {self.path}, not in the model: "
                "its embedding module holds no .weight (call the model with "
                "inputs_embeds=batch['inputs_embeds']; resize the vocabulary before "
                "embedpipe.hf.offload; freeze the table with "
                "model.get_input_embeddings().requires_grad_(False); or put the rows back with "
                "embedpipe.hf.restore(model, pipe))"
            )
        return super().__getattr__(name)

    def __deepcopy__(self, memo: dict[int, Any]) -> OffloadedEmbedding:
        # A copy would read the same live table, not a snapshot of it: an EMA (AveragedModel)
        # would never average the embeddings, a best-model copy or a frozen teacher would see
        # the rows as they go on training. Refused, not copied: it cannot be made exact.
        raise EmbeddingsOffloadedError(
            f"cannot copy a model whose word embeddings live in {self.path}: the copy would "
            "read the same table as it trains, not a snapshot of it (an EMA or AveragedModel "
            "would not average the embeddings; a best-model copy or a frozen teacher would "
            "see the rows change). Copy the model before embedpipe.hf.offload (the copy keeps "
            "its own nn.Embedding), or snapshot the table with pipe.checkpoint()"
        )

    def __getstate__(self) -> dict[str, Any]:
        # A model pickled whole (torch.save(model)) holds no rows, and when loaded would read
        # the table as it is then: the table's step goes with it, checked as a loaded state
        # dict's is (NOTE [ A state dict keeps the table's step ] in ``rowsource.py``).
        step: dict[str, Any] = {}
        stamp(self, step, "")
        return {**self.__dict__, "_loaded_step": taken_at(step, "")}

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self._register(self.path)  # a pipe on the table finds it, as one made here
        read_like_its_table(self)

    def _apply(self, fn: Any, recurse: bool = True) -> OffloadedEmbedding:
        # model.to(device) / .half() reach us here: follow them on an empty tensor (no memory)
        probe = fn(torch.empty(0, dtype=self.dtype, device=self.device))
        self.dtype, self.device = probe.dtype, probe.device
        with self._without_rows():
            return super()._apply(fn, recurse)

    def extra_repr(self) -> str:
        return (
            f"{self.num_embeddings}, {self.embedding_dim}, path={self.path!r}, dtype={self.dtype}"
        )


def ignore_in_ddp(model: nn.Module, placeholder: OffloadedEmbedding) -> None:
    """Tell ``DistributedDataParallel`` to leave the table's gradient parameter alone: its
    shape changes with every batch and its gradient is averaged by the pipe itself."""
    name = next((n for n, m in model.named_modules() if m is placeholder), None)
    if name is None:
        return
    ignored = set(getattr(model, "_ddp_params_and_buffers_to_ignore", ()))
    model._ddp_params_and_buffers_to_ignore = sorted(ignored | {f"{name}.rows" if name else "rows"})
