"""The offloaded embedding: the module that stands where a model's ``nn.Embedding`` was.

:class:`OffloadedEmbedding` holds no rows; a training pipe's gradient parameter is its one
parameter, so an optimizer and ``clip_grad_norm_`` over ``model.parameters()`` reach the table.
Every one made in this process is registered by its table's path: a pipe on that table adopts
them (``EmbeddingPipe.attach``) and asks them for the dtype ``inputs_embeds`` should have.
``embedpipe.hf.offload`` makes one; ``embedpipe.lightning`` and DDP see it through
:func:`ignore_in_ddp`.
"""

from __future__ import annotations

import copy
import functools
import os
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import EmbeddingsOffloadedError, InvalidRowsError

#: The offloaded embedding modules of this process, by table path, oldest first: a pipe on that
#: table adopts the newest one's gradient parameter and attaches it to all of them.
_OFFLOADED: dict[str, list[weakref.ref[OffloadedEmbedding]]] = {}


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


# NOTE [ Scaled word embeddings ]
# Many models' word embedding does more than gather rows: Gemma's, MBart's, M2M100's, NLLB's,
# Blenderbot's, XGLM's... multiply them by ``embed_scale`` (sqrt(hidden size)) in the embedding
# module's forward, ``embedding(ids) * embed_scale`` (a float) or ``* embed_scale.to(weight.dtype)``
# (a buffer, which follows ``model.to(dtype)``). A model called with ``inputs_embeds`` skips that
# module, so the pipe must apply the scale itself or the model would see unscaled rows, without an
# error. ``OffloadedEmbedding.replacing`` takes the scale from the module it replaces, after
# checking on a few ids, in train and eval mode, that the module's output is exactly the rows
# times that scale (or the rows); any other module (a ``max_norm``, ``scale_grad_by_freq``, a
# forward that normalises or drops out, a forward hook) is refused before anything is written.
# A batch's ``inputs_embeds`` is then ``F.embedding(inverse, rows)`` cast to the model's dtype and
# multiplied by the scale in the module's own form, so it equals the module's output bit for bit
# and the gradient reaching the rows is the scaled one, as the embedding's weight would get.

#: Ids tried when checking what an embedding module computes (NOTE [ Scaled word embeddings ]).
_PROBE_IDS = 16


def _scale_of(module: nn.Module) -> float | torch.Tensor | None:
    """The ``embed_scale`` ``module`` multiplies its rows by, None if it only gathers them;
    raises :class:`InvalidRowsError` if it does anything else (NOTE [ Scaled word embeddings ])."""
    name = type(module).__name__
    weight = module.weight
    if getattr(module, "max_norm", None) is not None or getattr(
        module, "scale_grad_by_freq", False
    ):
        raise InvalidRowsError(
            f"the input embedding ({name}) has max_norm or scale_grad_by_freq set: it rescales "
            "rows or gradients where embedpipe would gather rows only; unset them to offload it"
        )
    scale = getattr(module, "embed_scale", None)
    if not isinstance(scale, (int, float, torch.Tensor)) or isinstance(scale, bool):
        scale = None
    if isinstance(scale, torch.Tensor) and scale.numel() != 1:
        scale = None
    ids = torch.arange(min(_PROBE_IDS, weight.shape[0]), device=weight.device)[None]
    rows = F.embedding(ids, weight.detach())
    mode = module.training
    try:
        # NOTE: fork_rng so that a module that draws (dropout) leaves the program's draws as they were
        with torch.no_grad(), torch.random.fork_rng(devices=_devices(weight)):
            outputs = []
            for training in (True, False):
                module.train(training)
                outputs.append(module(ids))
    except Exception as e:
        raise InvalidRowsError(
            f"the input embedding ({name}) could not be called with a batch of ids to check what "
            f"it computes ({type(e).__name__}: {e}); embedpipe offloads nn.Embedding and "
            "embeddings that scale their rows by embed_scale"
        ) from e
    finally:
        module.train(mode)
    for candidate in (None, scale) if scale is not None else (None,):
        expected = rows if candidate is None else _scaled(rows, candidate)
        if all(isinstance(o, torch.Tensor) and _same(o, expected) for o in outputs):
            return candidate
    raise InvalidRowsError(
        f"the input embedding ({name}) returns something other than the rows it looks up"
        + (f" times its embed_scale ({float(scale):g})" if scale is not None else "")
        + ": a model called with inputs_embeds skips that module, so offloading it would change "
        "what the model computes. embedpipe offloads nn.Embedding and embeddings that multiply "
        "their rows by embed_scale; remove forward hooks or dropout from the embedding module"
    )


def _devices(weight: torch.Tensor) -> list[torch.device]:
    return [weight.device] if weight.device.type == "cuda" else []


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and bool(torch.equal(a, b))


def _scaled(embeds: torch.Tensor, scale: float | torch.Tensor) -> torch.Tensor:
    """``embeds * scale`` as the scaled embeddings compute it: a buffer cast to the rows' dtype
    first, a number as it is."""
    if isinstance(scale, torch.Tensor):
        return embeds * scale.to(device=embeds.device, dtype=embeds.dtype)
    return embeds * scale


def _without_weight(module: nn.Module) -> nn.Module:
    """A shallow copy of ``module`` without its weight: what :meth:`OffloadedEmbedding.restore`
    puts the rows back into, so the model gets a module of its own class again."""
    template = copy.copy(module)
    template._parameters = {k: v for k, v in module._parameters.items() if k != "weight"}
    template._buffers = dict(module._buffers)
    template._modules = dict(module._modules)
    return template


def recorded_scale(metadata: dict[str, Any]) -> float | torch.Tensor | None:
    """The row scale a table's metadata records (:meth:`OffloadedEmbedding.recorded`)."""
    recorded = metadata.get("embed_scale")
    if recorded is None:
        return None
    value = float(recorded["value"])
    return torch.tensor(value, dtype=torch.float32) if recorded["buffer"] else value


def finish_embeds(
    path: str, recorded: float | torch.Tensor | None, embeds: torch.Tensor
) -> torch.Tensor:
    """``embeds`` gathered from the table at ``path`` as the models offloaded to it take them
    (:meth:`OffloadedEmbedding.finish`): in their dtype if they agree on one (a model cast after
    ``offload``: ``model.half()``), else the table's; times their scale. Several models on one
    table that scale their rows differently raise: a batch cannot tell which one reads it. With
    no model in this process, times the scale the table ``recorded`` at ``offload``."""
    modules = offloaded_embeddings(path)
    if not modules:
        return embeds if recorded is None else _scaled(embeds, recorded)
    scales = {m.scale_value for m in modules}
    if len(scales) > 1:
        raise EmbeddingsOffloadedError(
            f"the models offloaded to {path} scale their embeddings differently ({sorted(map(str, scales))}); "
            "offload each to a table of its own"
        )
    if len({m.dtype for m in modules}) == 1:
        return modules[0].finish(embeds)
    scale = modules[0].embed_scale
    return embeds if scale is None else _scaled(embeds, scale)


class OffloadedEmbedding(nn.Module):
    """Stands where a model's ``nn.Embedding`` was; holds no rows.

    Keeps ``num_embeddings``, ``embedding_dim``, ``padding_idx`` and the table's ``path``, plus
    the ``dtype`` and ``device`` the model expects ``inputs_embeds`` in (they follow
    ``model.to(...)``). :func:`offload` puts one in a model; a model rebuilt in a new process
    (to resume training on a table that exists) takes one by hand:
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
        if isinstance(embed_scale, torch.Tensor):  # a buffer, as the scaled module's: follows .to
            self.register_buffer("embed_scale", embed_scale.detach().clone(), persistent=False)
        else:
            self.embed_scale = embed_scale
        self._template: nn.Module | None = None  # the module it replaced, without its weight
        # a pipe made on the table from now on finds it (and attaches its parameter to it)
        _OFFLOADED.setdefault(_resolved(path), []).append(weakref.ref(self))

    @classmethod
    def replacing(cls, module: nn.Module, path: str) -> OffloadedEmbedding:
        """One to stand where ``module`` (a model's word embedding, holding its weight) is, for
        the table at ``path``: its shape, ``padding_idx``, dtype, device and the scale it
        multiplies its rows by (NOTE [ Scaled word embeddings ]); :meth:`restore` gives back a
        module of ``module``'s class. A model rebuilt to resume on an existing table uses it too:
        ``model.set_input_embeddings(OffloadedEmbedding.replacing(model.get_input_embeddings(),
        path))``. Raises :class:`InvalidRowsError` for a module that does more than that."""
        weight = module.weight
        placeholder = cls(
            *weight.shape,
            path,
            padding_idx=getattr(module, "padding_idx", None),
            dtype=weight.dtype,
            device=weight.device,
            embed_scale=_scale_of(module),
        )
        placeholder._template = _without_weight(module)
        # the gradient parameter a pipe on the table will adopt (an optimizer built now holds
        # it); a weight frozen before (requires_grad False) leaves the table frozen, as it was
        empty = torch.empty(0, weight.shape[1], device=weight.device)
        placeholder.attach(nn.Parameter(empty, requires_grad=weight.requires_grad))
        return placeholder

    def recorded(self) -> dict[str, Any]:
        """What the table's metadata keeps of the module: its ``padding_idx`` (the pipe's
        default) and its row scale (for a pipe in a process with no model: ``embedpipe
        convert``), as :func:`recorded_scale` reads it back."""
        metadata: dict[str, Any] = {}
        if self.padding_idx is not None:
            metadata["padding_idx"] = int(self.padding_idx)
        if self.embed_scale is not None:
            buffer = isinstance(self.embed_scale, torch.Tensor)
            metadata["embed_scale"] = {"value": self.scale_value, "buffer": buffer}
        return metadata

    def finish(self, embeds: torch.Tensor) -> torch.Tensor:
        """``embeds``, the gathered rows, as the replaced module returned them: in the model's
        dtype, times its scale (NOTE [ Scaled word embeddings ])."""
        if embeds.dtype != self.dtype:
            embeds = embeds.to(self.dtype)
        return embeds if self.embed_scale is None else _scaled(embeds, self.embed_scale)

    def restore(self, weight: torch.Tensor) -> nn.Module:
        """The replaced module again (an ``nn.Embedding`` for one made by hand), holding
        ``weight``, on the model's device and in its dtype."""
        if self._template is None and self.embed_scale is not None:
            raise EmbeddingsOffloadedError(
                f"this model's embedding scaled its rows by {self.scale_value:g} and was "
                "offloaded by hand: set the weight of a module of the model's own embedding class "
                "to the table's rows (Table.to_tensor()) instead"
            )
        if self._template is None:
            module = nn.Embedding(
                self.num_embeddings, self.embedding_dim, padding_idx=self.padding_idx
            )
        else:
            module = _without_weight(self._template)
        module.weight = nn.Parameter(weight)
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

    def _save_to_state_dict(self, *args: Any, **kwargs: Any) -> None:
        with self._without_rows():
            super()._save_to_state_dict(*args, **kwargs)

    def _load_from_state_dict(
        self, state_dict: dict[str, Any], prefix: str, *args: Any, **kwargs: Any
    ) -> None:
        if getattr(self, "_skip_weight", False):  # a checkpoint's copy of the table's rows
            state_dict.pop(prefix + "weight", None)
        with self._without_rows():
            super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def _error(self) -> EmbeddingsOffloadedError:
        return EmbeddingsOffloadedError(
            f"the word embeddings of this model live in {self.path}; call the model with "
            "inputs_embeds=batch['inputs_embeds'] from embedpipe's loader, not input_ids"
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
