"""``offload``'s check that the model computes from ``inputs_embeds`` what it did from ``input_ids``.

NOTE [ The model probed before offload ]
A model that is given ``inputs_embeds`` skips its word embedding, and whatever its own forward
did with the looked-up rows or the ids. The embedding module's own scale (Gemma, MBart) is found
on the module (``pipe/rowscale.py``), and the positions and pooled token some models find in the
ids are hooked (``pipe/derived.py``); anything else would change what the model computes, without
an error: Marian, Pegasus, FSMT, FalconH1... multiply the looked-up rows by ``embed_scale`` or
``embedding_multiplier`` in the model's forward, on the lookup only; Gemma 4's per-layer inputs
read the embedding's weight even when given ``inputs_embeds``.

So before anything is written, :func:`check` runs the model on a few ids (one row of 4 real
tokens: no padding, no special ids, non-zero rows; then one with the special ids the config
names, where a head may look for them: Longformer's question answering, Splinter's), in eval
mode, with torch's random state and the modules' attributes kept (BigBird switches to full
attention for good on a short input): once with ``input_ids`` and the embedding in place, once
with the placeholder in place and ``inputs_embeds`` as the pipe would hand them (the embedding
module's output for those ids, carrying the ids as a batch's do). It tries the outermost module that holds the embedding and
takes both ``input_ids`` and ``inputs_embeds`` and runs both ways (an encoder-decoder's encoder,
where the whole model asks for decoder inputs). The outputs must be equal bit for bit:

- equal: the model is offloaded as it is;
- equal once the rows are multiplied by the module's ``embed_scale`` or ``embedding_multiplier``
  (a number): the placeholder carries that scale, as it carries an embedding module's own;
- the placeholder read (``EmbeddingsOffloadedError``), or anything else: ``InvalidRowsError``
  naming the module, and the model is left as it was.

Where no module can be run with the ids alone (a model that needs other inputs), nothing is
checked. Non-finite outputs (weights not initialised) cannot be compared and are not.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from ..errors import EmbeddingsOffloadedError, InvalidRowsError
from ..pipe.callhooks import has_hooks, hooks_set_aside
from ..pipe.derived import alias, text_config
from ..pipe.placeholder import OffloadedEmbedding
from ..pipe.rowscale import devices, same, scaled
from ..worker.batch import GATHERED_IDS

#: Real tokens in the probe's one row.
PROBE_TOKENS = 4
#: Attributes of a module that multiplies the looked-up rows in its own forward.
MODEL_SCALES = ("embed_scale", "embedding_multiplier")


def check(model: nn.Module, embeddings: nn.Module, placeholder: OffloadedEmbedding) -> None:
    """See the NOTE. Leaves the model's modules, their attributes, the embedding and torch's
    random state as they were."""
    ids = _probe_ids(model, embeddings)
    if ids is None:
        return
    # the embedding's hooks run on the pipe's rows later, not on the probe's
    with (
        kept_as_they_were(model),
        torch.no_grad(),
        torch.random.fork_rng(devices=devices(ids)),
        hooks_set_aside(embeddings),
        hooks_set_aside(placeholder),  # (it holds the same dicts)
    ):
        for module in model.modules():  # the flags only: model.eval() re-kernelizes a HF model
            module.training = False
        candidates, scales = _candidates(model, embeddings)
        for rows in (ids, _with_special_ids(model, embeddings, ids)):
            for module in candidates if rows is not None else ():
                # where the row cannot run, as the one choice of one question (a multiple-
                # choice head takes (batch, choices, length) ids)
                ran = _compare(model, module, embeddings, placeholder, rows, scales)
                if ran or (
                    ran is None
                    and _compare(model, module, embeddings, placeholder, rows[None], scales)
                ):
                    break


@contextmanager
def kept_as_they_were(model: nn.Module) -> Iterator[None]:
    """The model's modules, and each one's attributes, put back after the block: a forward
    may change them for good (BigBird's switches to full attention for a short input, and
    replaces its attention modules)."""
    modules = dict(model.named_modules(remove_duplicate=False))
    attributes = {module: dict(vars(module)) for module in modules.values()}
    try:
        yield
    finally:
        _put_back(model, modules)
        for module, saved in attributes.items():
            state = vars(module)
            for name in [name for name in state if name not in saved]:
                del state[name]
            for name, value in saved.items():
                if state.get(name, _MISSING) is not value:
                    state[name] = value


_MISSING = object()


def _compare(
    model: nn.Module,
    module: nn.Module,
    embeddings: nn.Module,
    placeholder: OffloadedEmbedding,
    ids: torch.Tensor,
    scales: list[float],
) -> bool | None:
    """True when ``module`` computes the same both ways (maybe with a scale, now on the
    placeholder); None when it cannot be run both ways; raises when it differs."""
    no_cache = _no_cache(module)
    try:  # the model as given: its own embedding in place
        expected = _first(module(input_ids=ids, **no_cache))
        embeds = embeddings(ids)
    except Exception:
        return None
    if expected is None or not expected.isfinite().all():
        return None  # weights not initialised: nothing to compare
    name = type(module).__name__
    tries: list[float | None] = [None]
    if placeholder.embed_scale is None:
        tries += scales
    elif placeholder.in_model:  # found on an earlier row: the model's own scale
        tries = [float(placeholder.embed_scale)]
    for scale in tries:
        given = embeds if scale is None else scaled(embeds, scale)
        setattr(given, GATHERED_IDS, lambda on_device=True: ids)  # as a batch's: for the hooks
        try:
            with swapped_in(model, placeholder):
                got = _first(module(inputs_embeds=given, **no_cache))
        except EmbeddingsOffloadedError as e:
            raise InvalidRowsError(
                f"{name} reads its word embeddings even when given inputs_embeds ({e}); it "
                "cannot run with them offloaded"
            ) from None
        except Exception:
            return None
        if got is None:
            return None
        if same(got, expected):
            if scale is not None:
                placeholder.scale_in_model(float(scale))
            return True
    raise InvalidRowsError(
        f"{name} computes something else from inputs_embeds than from input_ids (checked on "
        f"the ids {ids.flatten().tolist()}): it does more with the ids or the rows than look "
        "them up (a special id it looks for: a separator, a question token), so offloading its "
        "word embeddings would change what it computes"
    )


@contextmanager
def swapped_in(model: nn.Module, placeholder: OffloadedEmbedding) -> Iterator[dict[str, nn.Module]]:
    """``placeholder`` put in by ``model.set_input_embeddings`` for the block, which gets the
    modules by name as they are then; afterwards every module is put back where it was
    (``set_input_embeddings`` of the old embedding would also tie the modules it replaced)."""
    before = dict(model.named_modules(remove_duplicate=False))
    model.set_input_embeddings(placeholder)
    try:
        yield dict(model.named_modules(remove_duplicate=False))
    finally:
        _put_back(model, before)


def _put_back(model: nn.Module, modules: dict[str, nn.Module]) -> None:
    """Every module of ``modules`` (``named_modules()`` as it was) where it was."""
    for name, module in modules.items():
        if not name:
            continue
        parent_name, _, attribute = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        if getattr(parent, attribute, None) is not module:
            setattr(parent, attribute, module)


def refuse_displacing(
    model: nn.Module, embeddings: nn.Module, placeholder: OffloadedEmbedding
) -> None:
    """``set_input_embeddings`` must put the placeholder only where ``embeddings`` was: a model
    whose encoder has an embedding of its own (BART with ``tie_word_embeddings=False``) would
    lose it, and compute with the table's rows instead, without an error."""
    before = dict(model.named_modules(remove_duplicate=False))
    with swapped_in(model, placeholder) as after:
        pass
    displaced = [
        n for n, m in after.items() if m is placeholder and not alias(before.get(n), embeddings)
    ]
    if displaced:
        raise InvalidRowsError(
            f"{type(model).__name__}.set_input_embeddings also replaces {', '.join(displaced)}, "
            "an embedding other than get_input_embeddings(): offloading would drop its rows. "
            "Tie them (one embedding module) or offload a model with one input embedding"
        )
    hooked = [
        n
        for n, m in after.items()
        if m is placeholder and before[n] is not embeddings and has_hooks(before[n])
    ]
    if hooked:  # (BART's encoder calls encoder.embed_tokens, a module over shared's weight)
        raise InvalidRowsError(
            f"hooks are registered on {', '.join(hooked)}, a module over the same weight as "
            "get_input_embeddings() that offload replaces too: the pipe runs the hooks of "
            "get_input_embeddings() only. Remove them and register them on "
            "model.get_input_embeddings() after offload"
        )


def _no_cache(module: nn.Module) -> dict[str, Any]:
    """``use_cache=False`` where the forward takes it: a cache changes nothing here, and some
    hybrid models' caches fail on a one-row probe."""
    try:
        return (
            {"use_cache": False}
            if "use_cache" in inspect.signature(module.forward).parameters
            else {}
        )
    except (TypeError, ValueError):
        return {}


def _probe_ids(model: nn.Module, embeddings: nn.Module) -> torch.Tensor | None:
    """One row of real token ids: not padding nor a special id, with non-zero rows; as long as
    a multiple of the model's attention window where it has one (Longformer, LED pad to it)."""
    weight = embeddings.weight
    text = text_config(model)
    special = {getattr(embeddings, "padding_idx", None)}
    for key in ("pad_token_id", "bos_token_id", "eos_token_id"):
        value = getattr(text, key, None)  # Llama 3's eos_token_id is a list
        special |= set(value) if isinstance(value, (list, tuple)) else {value}
    picked: list[int] = []
    for start in range(0, weight.shape[0], 256):
        rows = weight[start : start + 256].detach()
        for offset in (rows != 0).any(dim=1).nonzero().flatten().tolist():
            if start + offset not in special:
                picked.append(start + offset)
            if len(picked) == PROBE_TOKENS:
                window = getattr(text, "attention_window", None)
                window = max(window) if isinstance(window, (list, tuple)) else window
                length = window if isinstance(window, int) and window > 0 else PROBE_TOKENS
                row = (picked * (length // PROBE_TOKENS + 1))[:length]
                return torch.tensor([row], device=weight.device)
    return None


#: The special ids a head may look for in ``input_ids`` (Longformer's question answering puts
#: global attention on the tokens before the first separator; Splinter's pools the question
#: token), beside the real tokens, in the second row the probe tries.
SPECIAL_IDS = ("sep_token_id", "cls_token_id", "mask_token_id", "question_token_id")


def _with_special_ids(
    model: nn.Module, embeddings: nn.Module, ids: torch.Tensor
) -> torch.Tensor | None:
    """The probe's row with the special ids the model's config names, laid out as a question and
    a context (``cls q sep sep others c sep``, then real tokens), as long as the first row or a
    multiple of it; None if the config names none."""
    text = text_config(model)
    found = {key: getattr(text, key, None) for key in SPECIAL_IDS}
    found = {
        k: v
        for k, v in found.items()
        if isinstance(v, int)
        and 0 <= v < embeddings.weight.shape[0]
        and v != getattr(embeddings, "padding_idx", None)
    }
    if not found:
        return None
    real = ids[0].tolist()
    sep, cls = found.pop("sep_token_id", None), found.pop("cls_token_id", None)
    row = [cls] if cls is not None else []
    row += [real[0], *([sep, sep] if sep is not None else []), *found.values(), real[1]]
    row += [sep] if sep is not None else []
    length = -(-len(row) // len(real)) * len(real)
    row += (real * (length // len(real)))[: length - len(row)]
    return torch.tensor([row], device=ids.device)


def _candidates(model: nn.Module, embeddings: nn.Module) -> tuple[list[nn.Module], list[float]]:
    """The modules holding ``embeddings`` that take ``input_ids`` and ``inputs_embeds``,
    outermost first; and the scales (``MODEL_SCALES``) of every module holding it."""
    places = [n for n, m in model.named_modules(remove_duplicate=False) if m is embeddings]
    found, scales = [], []
    for name, module in model.named_modules():
        if module is embeddings or not any(p.startswith(f"{name}.") or not name for p in places):
            continue
        for attribute in MODEL_SCALES:
            value = getattr(module, attribute, None)
            if _number(value) and value not in scales:
                scales.append(value)
        try:
            parameters = inspect.signature(module.forward).parameters
        except (TypeError, ValueError):
            continue
        if {"input_ids", "inputs_embeds"} <= parameters.keys():
            found.append(module)
    return found, scales


def _first(output: Any) -> torch.Tensor | None:
    if isinstance(output, torch.Tensor):
        return output
    try:
        first = output[0]
    except (TypeError, IndexError, KeyError):
        return None
    return first if isinstance(first, torch.Tensor) else None


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value != 1
