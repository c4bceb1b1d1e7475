"""What a model derives from ``input_ids``, which ``inputs_embeds`` alone do not carry.

NOTE [ What a model derives from input_ids ]
A model called with ``inputs_embeds`` instead of ``input_ids`` skips its word embedding, and it
also loses what some models compute from the ids themselves:

- **Positions that skip padding** (RoBERTa, XLM-R, CamemBERT, Longformer, MPNet, Data2Vec,
  M2M100...): their embedding block numbers the positions of non-padding tokens from
  ``padding_idx + 1`` and gives padding the position ``padding_idx``. Given ``inputs_embeds``, it
  numbers every position in turn: a left-padded row, or padding inside a row, moves the real
  tokens' positions.
- **The token a classifier pools** (``*ForSequenceClassification`` of Llama, Mistral, Qwen,
  Gemma, GPT-2, OPT, Bloom, Falcon...): each row's last token that is not ``pad_token_id``,
  found in ``input_ids``. Given ``inputs_embeds``, it pools the last position, which in a
  right-padded row is padding (transformers logs a warning, once).

Either would train another model without an error. So every ``inputs_embeds`` a batch makes
carries the ids it gathered (``worker/batch.py``: ``GATHERED_IDS``), and :func:`watch` puts a
forward pre-hook on the model's modules that do either:

- a module whose ``forward`` takes ``input_ids`` and ``inputs_embeds`` and numbers positions
  from the ids (its source calls ``create_position_ids_from_input_ids``) is given the batch's
  ids as ``input_ids`` too, when called without them: it numbers positions from them, and uses
  ``inputs_embeds`` for the rows as it always does, so it computes what it did with the ids;
- a classifier that pools the last non-padding token raises when it would pool another token
  than the last position in any row, naming the rows and the remedy (pad on the left, where the
  last token is a real one in every row, or give each row its own batch).

A third kind is not about the ids: a module holding the word embedding that takes
``inputs_embeds`` (BERT's embeddings block, Llama's model) checks that it is given what the
hooks on the embedding ran on (:func:`read_once`, NOTE [ Hooks on the offloaded embedding ]).

``embedpipe.hf.offload`` and ``EmbeddingPipe.attach`` call :func:`watch`. Modules are recognised
by their code (duck-typed; no import of transformers). ``inputs_embeds`` that the loop made from
a batch's (``embeds * 2``, ``.to(device)``) lose the ids: a pooling classifier then falls back to
the attention mask (right padding raises), and a position-numbering block to numbering every
position, as without embedpipe.
"""

from __future__ import annotations

import inspect
from functools import partial
from typing import Any

import torch
from torch import nn

from ..errors import EmbeddingsOffloadedError
from ..worker.batch import gathered_ids
from .callhooks import Hooked, exact_anywhere, has_hooks
from .placeholder import OffloadedEmbedding

_WATCHED = "_embedpipe_watched"


def watch(model: nn.Module, embeddings: nn.Module | None = None) -> list[tuple[nn.Module, Any]]:
    """Hook the modules of ``model`` that derive positions or the pooled token from
    ``input_ids`` (see the NOTE), and those holding its word ``embeddings`` (default:
    ``model.get_input_embeddings()``) that take ``inputs_embeds`` (:func:`read_once`); once per
    module. Returns the hooks it added, for :func:`unwatch`."""
    if embeddings is None and hasattr(model, "get_input_embeddings"):
        embeddings = model.get_input_embeddings()
    added = []
    for module in model.modules():
        if getattr(module, _WATCHED, False):
            continue
        source = _forward_source(module)
        if source is None:
            continue
        signature = inspect.signature(module.forward)
        if "inputs_embeds" not in signature.parameters:
            continue
        hooks = []
        if embeddings is not None and any(
            isinstance(c, OffloadedEmbedding) or alias(c, embeddings) for c in module.children()
        ):
            hooks.append(read_once)
        if "input_ids" in signature.parameters:
            if "create_position_ids_from_input_ids" in source:
                hooks.append(_positions_from_ids)
            elif "last_non_pad_token" in source:
                hooks.append(_pooled_token_is_last)
        for hook in hooks:
            handle = module.register_forward_pre_hook(partial(hook, signature), with_kwargs=True)
            added.append((module, handle))
        if hooks:
            setattr(module, _WATCHED, True)
    return added


def unwatch(added: list[tuple[nn.Module, Any]]) -> None:
    """Remove hooks :func:`watch` added (an ``offload`` that failed after it)."""
    for module, handle in added:
        handle.remove()
        setattr(module, _WATCHED, False)


def text_config(model: nn.Module) -> Any:
    """The configuration of ``model``'s text part (a multimodal model's ``text_config``)."""
    config = getattr(model, "config", None)
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def _forward_source(module: nn.Module) -> str | None:
    forward = type(module).forward
    if forward is nn.Module.forward or getattr(forward, "__module__", "").startswith("torch."):
        return None
    try:
        return inspect.getsource(forward)
    except (OSError, TypeError):
        return None


def _bound(
    signature: inspect.Signature, args: tuple, kwargs: dict
) -> inspect.BoundArguments | None:
    try:
        return signature.bind_partial(*args, **kwargs)
    except TypeError:
        return None


def _positions_from_ids(
    signature: inspect.Signature, module: nn.Module, args: tuple, kwargs: dict
) -> Any:
    bound = _bound(signature, args, kwargs)
    if bound is None or bound.arguments.get("input_ids") is not None:
        return None
    ids = gathered_ids(bound.arguments.get("inputs_embeds"))
    if ids is None:
        return None
    bound.arguments["input_ids"] = ids
    return bound.args, bound.kwargs


def alias(module: nn.Module | None, embeddings: nn.Module) -> bool:
    """``module`` is ``embeddings``, or a module of its class over the same weight (transformers
    5 ties an encoder's and a decoder's embedding to the shared one by their weight: BART's
    ``encoder.embed_tokens`` beside ``shared``, which offload replaces too)."""
    if module is embeddings:
        return True
    mine, theirs = getattr(module, "weight", None), getattr(embeddings, "weight", None)
    return (
        type(module) is type(embeddings)
        and isinstance(mine, torch.Tensor)
        and isinstance(theirs, torch.Tensor)
        and mine.shape == theirs.shape
        and mine.data_ptr() == theirs.data_ptr()
    )


def read_once(signature: inspect.Signature, module: nn.Module, args: tuple, kwargs: dict) -> Any:
    """The module that would have called the word embedding is given what the hooks on it
    (NOTE [ Hooks on the offloaded embedding ] in ``callhooks.py``) would have returned there:
    the read they ran on, or at a second forward pass on that read (R-Drop, a second
    evaluation) the read again, the hooks run anew as at each call of ``nn.Embedding`` (not in a
    checkpoint's recomputation during backward, which must see the first pass's rows).
    Anything else (a slice of a read, a copy, a concatenation, a cast) had the hooks run on
    other rows than the model is given: it raises, unless every hook gives the same rows
    wherever it runs (``enable_input_require_grads``)."""
    bound = _bound(signature, args, kwargs)
    embeds = None if bound is None else bound.arguments.get("inputs_embeds")
    placeholder = next((c for c in module.children() if isinstance(c, OffloadedEmbedding)), None)
    if (
        not isinstance(embeds, torch.Tensor)
        or placeholder is None
        or not has_hooks(placeholder)
        or exact_anywhere(placeholder)
    ):
        return None
    tag = Hooked.of(embeds)
    if tag is None or tuple(embeds.shape) != tag.shape:
        what = "not a read of batch['inputs_embeds']" if tag is None else "a part of a read"
        raise EmbeddingsOffloadedError(
            f"{type(module).__name__} was given inputs_embeds of shape {tuple(embeds.shape)}, "
            f"{what} (a slice, a copy, a concatenation, a cast): the hooks on the word embedding "
            "(NEFTune...) ran on the read's rows, where nn.Embedding would run them on what the "
            "model is given. Give the model batch['inputs_embeds'] as read (one batch per "
            "forward pass), or remove the hooks"
        )
    if id(module) not in tag.readers:
        tag.readers.add(id(module))
        return None
    if torch._C._current_graph_task_id() != -1:
        return None  # a checkpoint recomputing its forward in backward: the same rows again
    again = tag.again()  # a second pass: the hooks run again, as nn.Embedding's would
    Hooked.of(again).readers.add(id(module))
    bound.arguments["inputs_embeds"] = again.reshape(embeds.shape)
    return bound.args, bound.kwargs


def _pooled_token_is_last(
    signature: inspect.Signature, module: nn.Module, args: tuple, kwargs: dict
) -> None:
    bound = _bound(signature, args, kwargs)
    if bound is None or bound.arguments.get("input_ids") is not None:
        return
    embeds = bound.arguments.get("inputs_embeds")
    pad = getattr(text_config(module), "pad_token_id", None)
    if embeds is None or pad is None:
        return
    ids = gathered_ids(embeds, on_device=False)  # on the host: no wait for the accelerator
    if ids is not None:
        # transformers' own choice: the rightmost position whose id is not pad_token_id
        positions = torch.arange(ids.shape[-1], device=ids.device)
        pooled = (positions * (ids != pad)).argmax(-1)
        rows = (pooled != ids.shape[-1] - 1).nonzero().flatten().tolist()
        seen = f"whose last id is the pad_token_id {pad}"
    else:
        mask = bound.arguments.get("attention_mask")
        if not isinstance(mask, torch.Tensor) or mask.dim() != 2:
            return
        rows = (mask[:, -1] == 0).nonzero().flatten().tolist()
        seen = "whose attention mask ends in padding"
    if rows:
        raise EmbeddingsOffloadedError(
            f"{type(module).__name__} pools each row's last token that is not padding, which it "
            "finds in input_ids; given inputs_embeds it pools the last position instead, and "
            f"rows {rows[:8]} of this batch end in padding ({seen}): it would train on the "
            "padding. Pad on the left (tokenizer.padding_side = 'left'), so that every row ends "
            "in a real token"
        )
