"""What a model's word embedding computes besides the lookup: a scale, or nothing else.

NOTE [ Scaled word embeddings ]
Many models' word embedding does more than gather rows: Gemma's, MBart's, M2M100's, NLLB's,
Blenderbot's, XGLM's... multiply them by ``embed_scale`` (sqrt(hidden size)) in the embedding
module's forward, ``embedding(ids) * embed_scale`` (a float) or ``* embed_scale.to(weight.dtype)``
(a buffer, which follows ``model.to(dtype)``); Marian's, Pegasus', FalconH1's... do it in the
model's forward, on the lookup only (``embedpipe/hf/probe.py`` finds those). A model called with
``inputs_embeds`` skips that multiplication, so the pipe must apply the scale itself or the
model would see unscaled rows, without an error.

:func:`scale_of` takes the scale from the module, after checking what it computes: it calls the
module, in train and in eval mode (torch's random state saved and put back), with a synthetic
weight (finite, non-zero, distinct values: the module's own may be zeros, or not initialised)
and requires its output to be exactly those rows, or those rows times ``embed_scale``. Anything
else is refused before anything is written: ``max_norm`` or ``scale_grad_by_freq``, a forward
that normalises or drops out, a module holding more than its weight (an adapter, a
parametrization). Its hooks are set aside for the check: they go to the offloaded embedding,
which runs them on the pipe's rows (NOTE [ Hooks on the offloaded embedding ] in
``callhooks.py``). A batch's ``inputs_embeds`` are then
``F.embedding(inverse, rows)`` in the model's dtype times the scale in the module's own form
(:func:`scaled`), so they equal the module's output bit for bit and the gradient reaching the
rows is the scaled one, as the embedding's weight would get. The table records the scale
(:func:`recorded_scale`): a pipe in a process with no model (``embedpipe convert``), or whose
placeholder was built by hand, applies it too.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

from ..errors import InvalidRowsError
from .callhooks import hooks_set_aside

#: Ids tried when checking what an embedding module computes.
_PROBE_IDS = 16


def scale_of(module: nn.Module) -> float | torch.Tensor | None:
    """The ``embed_scale`` ``module`` multiplies its rows by, None if it only gathers them;
    raises :class:`InvalidRowsError` if it does anything else (see the NOTE)."""
    name = type(module).__name__
    weight = module._parameters.get("weight")
    if not isinstance(weight, torch.Tensor):
        raise InvalidRowsError(
            f"the input embedding ({name}) holds no weight parameter of its own; offload the "
            "nn.Embedding itself, before wrapping it (an adapter, a parametrization)"
        )
    others = [n for n in module._parameters if n != "weight"] + list(module._modules)
    if others:
        raise InvalidRowsError(
            f"the input embedding ({name}) holds more than its weight ({', '.join(others[:4])}): "
            "offload the nn.Embedding before wrapping it (an adapter, a parametrization)"
        )
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
    if isinstance(scale, torch.Tensor) and (scale.numel() != 1 or scale.device.type == "meta"):
        scale = None
    n = min(_PROBE_IDS, weight.shape[0])
    values = torch.linspace(0.25, 1.75, n * weight.shape[1], device=weight.device)
    synthetic = values.reshape(n, -1).to(weight.dtype)
    ids = torch.arange(n, device=weight.device)[None]
    rows = F.embedding(ids, synthetic)
    mode, padding_idx = module.training, getattr(module, "padding_idx", None)
    try:
        if isinstance(padding_idx, int) and padding_idx >= n:  # past the synthetic rows, which
            module.padding_idx = n - 1  # F.embedding checks: the last stands for it in the probe
        # fork_rng: a module that draws (dropout) leaves the program's draws as they were
        # the module's own computation: its hooks run on the pipe's rows (callhooks.py)
        with (
            torch.no_grad(),
            torch.random.fork_rng(devices=devices(weight)),
            hooks_set_aside(module),
        ):
            outputs = []
            for training in (True, False):
                module.train(training)
                outputs.append(functional_call(module, {"weight": synthetic}, (ids,)))
    except Exception as e:
        raise InvalidRowsError(
            f"the input embedding ({name}) could not be called with a batch of ids to check what "
            f"it computes ({type(e).__name__}: {e}); embedpipe offloads nn.Embedding and "
            "embeddings that scale their rows by embed_scale"
        ) from e
    finally:
        module.train(mode)
        if padding_idx is not None:
            module.padding_idx = padding_idx
    for candidate in (None, scale) if scale is not None else (None,):
        expected = rows if candidate is None else scaled(rows, candidate)
        if all(isinstance(o, torch.Tensor) and same(o, expected) for o in outputs):
            return candidate
    raise InvalidRowsError(
        f"the input embedding ({name}) returns something other than the rows it looks up"
        + (f" times its embed_scale ({float(scale):g})" if scale is not None else "")
        + ": a model called with inputs_embeds skips that module, so offloading it would change "
        "what the model computes. embedpipe offloads nn.Embedding and embeddings that multiply "
        "their rows by embed_scale; remove dropout or normalisation from the embedding module"
    )


def devices(tensor: torch.Tensor) -> list[torch.device]:
    """The accelerators whose random state ``fork_rng`` must keep for work on ``tensor``."""
    return [tensor.device] if tensor.device.type == "cuda" else []


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and bool(torch.equal(a, b))


def scaled(embeds: torch.Tensor, scale: float | torch.Tensor) -> torch.Tensor:
    """``embeds * scale`` as the scaled embeddings compute it: a buffer cast to the rows' dtype
    first, a number as it is."""
    if isinstance(scale, torch.Tensor):
        return embeds * scale.to(device=embeds.device, dtype=embeds.dtype)
    return embeds * scale


def without_weight(module: nn.Module) -> nn.Module:
    """A shallow copy of ``module`` without its weight (its only parameter: :func:`scale_of`),
    with a dict of buffers of its own: what ``OffloadedEmbedding.restore`` puts the rows back
    into, a module of the model's class (and gives the placeholder's hooks)."""
    template = copy.copy(module)
    template._parameters, template._modules = {}, {}
    template._buffers = dict(module._buffers)
    return template


def recorded_scale(metadata: dict[str, Any]) -> float | torch.Tensor | None:
    """The row scale a table's metadata records (``OffloadedEmbedding.recorded``); a buffer's
    as float64, exact for any dtype it is cast to."""
    recorded = metadata.get("embed_scale")
    if recorded is None:
        return None
    value = float(recorded["value"])
    return torch.tensor(value, dtype=torch.float64) if recorded["buffer"] else value


def recorded_in_model(metadata: dict[str, Any]) -> bool:
    """Whether the recorded scale is the model's forward's (Marian's), not the embedding's."""
    return bool((metadata.get("embed_scale") or {}).get("in_model", False))
