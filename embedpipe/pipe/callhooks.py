"""The hooks on a model's word embedding, run on the rows the pipe hands the model.

NOTE [ Hooks on the offloaded embedding ]
Code that wants the word embeddings' output registers a forward hook on
``model.get_input_embeddings()``, and a model called with ``inputs_embeds`` never calls that
module, so without more the hook would never run, without an error:

- ``model.enable_input_require_grads()`` (PEFT calls it for LoRA with gradient checkpointing)
  makes the embeddings' output require grad, so that a reentrant checkpoint of the first layer
  backpropagates into its LoRA weights when the table itself is frozen. Not run, every adapter
  weight in a checkpointed layer gets no gradient and never trains (torch only warns).
- NEFTune (``TrainingArguments(neftune_noise_alpha=...)``) adds uniform noise to the output in
  training mode. Not run, the model trains without the noise.

So the offloaded embedding keeps the hooks the replaced module had (the same dicts, so the
handles a caller holds still remove them) and those registered on it since, and every read of a
batch's ``inputs_embeds`` goes through them as the module's own call would have sent its output
(:func:`forward_hooks`): forward pre-hooks with ``(ids,)``, then the forward hooks with
``(ids,)`` and the rows, each hook's return value replacing the output, in torch's order, with
or without kwargs. The ids are the batch's gathered ids, on the rows' device; a multiple-choice
batch's ``(B, C, L)`` is given as ``(B * C, L)``, as the models view it before their
embedding. Where the model's forward multiplies the looked-up rows by a scale (Marian), the
hooks run before it (``OffloadedEmbedding.finish``).

The hooks run at the read, where ``nn.Embedding`` runs them at each forward pass: the module
that would have called the embedding checks what it is given (``derived.read_once``): a second
pass on one read runs them anew, and a slice, a copy or a cast of a read raises unless every
hook gives the same rows wherever it runs. What else cannot be made exact raises too: a
pre-hook that gives the module other ids (the rows were gathered for the batch's), and backward
hooks (autograd never reaches the module). Hooks registered for every module
(``torch.nn.modules.module.register_module_forward_hook``) are not run for it: the module is
not called.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from ..errors import EmbeddingsOffloadedError
from ..worker.batch import mark

#: The attribute of ``inputs_embeds`` whose rows went through the hooks: a :class:`Hooked`.
HOOKED = "_embedpipe_hooked"

#: The hook dicts of an ``nn.Module`` that travel with the word embedding it stands for.
HOOK_DICTS = (
    "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs",
    "_forward_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
    "_backward_pre_hooks",
    "_backward_hooks",
)


def take_hooks(into: nn.Module, source: nn.Module) -> None:
    """Give ``into`` the hook dicts of ``source`` (the same objects: a handle removes from
    either)."""
    for name in HOOK_DICTS:
        if hasattr(source, name):
            setattr(into, name, getattr(source, name))


@contextmanager
def hooks_set_aside(module: nn.Module) -> Iterator[None]:
    """Inside the block, ``module`` has no hooks (its own computation is being checked)."""
    saved = {name: getattr(module, name) for name in HOOK_DICTS if hasattr(module, name)}
    for name, hooks in saved.items():
        setattr(module, name, type(hooks)())
    try:
        yield
    finally:
        for name, hooks in saved.items():
            setattr(module, name, hooks)


def has_hooks(module: nn.Module) -> bool:
    return bool(
        module._forward_pre_hooks
        or module._forward_hooks
        or module._backward_pre_hooks
        or module._backward_hooks
    )


def forward_hooks(
    module: nn.Module, output: torch.Tensor, ids: Callable[[], torch.Tensor]
) -> torch.Tensor:
    """``output`` (what ``module`` would have returned for the batch's ``ids()``) after the
    hooks on ``module``, as ``module(ids)`` runs them (see the NOTE)."""
    if not has_hooks(module):
        return output
    if module._backward_pre_hooks or module._backward_hooks:
        raise EmbeddingsOffloadedError(
            f"a backward hook is registered on the offloaded word embedding of {module.path}: "
            "the model is called with inputs_embeds and never calls that module, so the hook "
            "could not run; hook the gradient of batch['inputs_embeds'] instead "
            "(inputs_embeds.register_hook)"
        )
    given, shape = ids(), output.shape
    flat = given.dim() > 2  # multiple choice: the model views (B, C, L) as (B * C, L) first
    if flat:
        given = given.reshape(-1, given.shape[-1])
        output = output.reshape(*given.shape, shape[-1])
    args: tuple[Any, ...] = (given,)
    kwargs: dict[str, Any] = {}
    for key, hook in list(module._forward_pre_hooks.items()):
        if key in module._forward_pre_hooks_with_kwargs:
            result = hook(module, args, kwargs)
            if result is not None:
                args, kwargs = result
        else:
            result = hook(module, args)
            if result is not None:
                args = result if isinstance(result, tuple) else (result,)
        if len(args) != 1 or kwargs or not _same(args[0], given):
            raise EmbeddingsOffloadedError(
                f"a forward pre-hook on the offloaded word embedding of {module.path} "
                f"({getattr(hook, '__qualname__', hook)}) changes the module's input; the pipe "
                "gathered the rows of the batch's own ids, so it cannot run. Change the ids in "
                "the batch before the model reads inputs_embeds (batch['input_ids'][...] = ...)"
            )
    for key, hook in list(module._forward_hooks.items()):
        if key in module._forward_hooks_with_kwargs:
            result = hook(module, args, kwargs, output)
        else:
            result = hook(module, args, output)
        if result is not None:
            output = result
    if flat:
        output = output.reshape(shape)
    return output


class Hooked:
    """What a read of ``inputs_embeds`` whose rows went through the hooks carries (``HOOKED``):
    how to read it again (``again``: the hooks run anew), the shape the hooks saw (the model
    gives that shape to the module holding the embedding), and the modules it reached."""

    def __init__(self, again: Callable[[], torch.Tensor], shape: tuple[int, ...]) -> None:
        self.again, self.shape = again, shape
        self.readers: set[int] = set()

    @classmethod
    def on(cls, output: torch.Tensor, again: Callable[[], torch.Tensor]) -> None:
        shape = tuple(output.shape)
        if len(shape) > 3:  # as forward_hooks gave it to them: (B * C, L, D)
            shape = (math.prod(shape[:-2]), *shape[-2:])
        mark(output, HOOKED, cls(again, shape))

    @staticmethod
    def of(embeds: torch.Tensor) -> Hooked | None:
        tag = getattr(embeds, HOOKED, None)
        if tag is None and embeds._base is not None:
            tag = getattr(embeds._base, HOOKED, None)
        return tag


#: Hooks that give the same rows run once or at every pass, on the whole read or on a part of
#: it: transformers' ``enable_input_require_grads`` and PEFT's own copy of it.
_ANYWHERE = frozenset({"make_inputs_require_grads", "make_inputs_require_grad"})


def exact_anywhere(module: nn.Module) -> bool:
    """All of ``module``'s forward hooks are ones whose result does not depend on when or on
    what part of a read they run."""
    hooks = [*module._forward_pre_hooks.values(), *module._forward_hooks.values()]
    return all(getattr(hook, "__name__", None) in _ANYWHERE for hook in hooks)


def _same(tensor: Any, ids: torch.Tensor) -> bool:
    return tensor is ids or (
        isinstance(tensor, torch.Tensor)
        and tensor.shape == ids.shape
        and tensor.dtype == ids.dtype
        and bool(torch.equal(tensor, ids))
    )
