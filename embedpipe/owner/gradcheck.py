"""What a backward pass hands the table's gradient, checked: the padding row left out, as
``nn.Embedding`` leaves it, and no NaN or inf let through to a step (``check_finite``); and a
gradient the table did not get, or one put in place of its own (NOTE below)."""

from __future__ import annotations

import warnings

import torch

from ..errors import NonFiniteGradientError


def refuse_non_finite(ids: torch.Tensor, grad: torch.Tensor, step: int) -> None:
    """Raise :class:`NonFiniteGradientError` if ``grad`` (the gradient of the rows ``ids`` for
    table step ``step``) holds a NaN or inf, before anything of the step is applied."""
    # A finite sum has no inf or NaN term: one reduction instead of an elementwise
    # isfinite (measured 30 us against 1.1 ms for 1,000 x 256 floats on CPU).
    if bool(torch.isfinite(grad.sum())):
        return
    bad = ~torch.isfinite(grad).all(dim=1)
    if bool(bad.any()):
        where = bad.nonzero()[:, 0].cpu()
        bad_ids = ids[where].tolist()
        value = grad[where[0]][~torch.isfinite(grad[where[0]])][0].item()
        raise NonFiniteGradientError(
            f"non-finite embedding gradient ({value}) for id {bad_ids[0]}"
            + (f" and {len(bad_ids) - 1} more ids" if len(bad_ids) > 1 else "")
            + f" in step {step}; nothing of this step was applied. "
            "Lower the learning rate, clip gradients or check the loss; "
            "check_finite=False skips this check"
        )


def without_padding(
    unique_ids: torch.Tensor, grad: torch.Tensor, padding_idx: int | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gradient of the rows other than the padding row, which gets none, as in
    ``nn.Embedding``: not even in a global norm."""
    if padding_idx is not None:
        keep = unique_ids != padding_idx
        if not bool(keep.all()):
            return unique_ids[keep], grad[keep.to(grad.device)]
    return unique_ids, grad


# NOTE [ A gradient the table did not get ]
# The table's gradient reaches it through the batch's rows (``batch.rows``, the leaf
# ``inputs_embeds`` is gathered from): a backward pass that reaches that leaf adds its gradient,
# for the batch's ids, to ``pipe.parameter.grad``, and the pipe knows which rows each of its
# lines is. ``pipe.parameter`` itself is in no graph. Two ways past that trained the table
# otherwise than nn.Embedding, silently (found by a probe):
#
# - a gradient taken for ``model.parameters()`` (``torch.autograd.grad(loss, params,
#   allow_unused=True)`` then ``p.grad = g``; ``loss.backward(inputs=list(model.parameters()))``;
#   ``torch.func.grad``) gives the table none, where nn.Embedding's weight gets its own: the
#   table never stepped. An optimizer step that holds the parameter, where batches were read to
#   train since its last step, none of their rows got a gradient, and another of its parameters
#   has one (a backward ran, and passed the table by; review: a loop that skips a batch with no
#   backward at all steps nothing, as torch does), warns once. A loop that leaves the table out
#   of a step on purpose freezes it (``pipe.parameter.requires_grad_(False)``);
# - a ``.grad`` the program assigned holds lines the pipe cannot tell the rows of: a gradient
#   saved before another batch's backward and put back trained that batch's rows. One made from
#   the gradient since the last backward (``p.grad = p.grad * 0.5``, noise added, two losses of
#   one batch combined) is exact, and nothing tells the two apart (review: refusing both refused
#   valid loops), so an optimizer step that finds a tensor the pipe did not make warns once and
#   steps it as the rows of the last backward. Put back in place (``p.grad.copy_(saved)``), it
#   is not seen at all.


def warn_replaced(stacklevel: int) -> bool:
    """Warn that ``pipe.parameter.grad`` is a tensor the pipe did not make (the NOTE above);
    True, once warned."""
    warnings.warn(
        "pipe.parameter.grad was replaced by a tensor embedpipe did not make (p.grad = ...): the "
        "table steps it as the gradient of the rows of the last backward pass, which is exact "
        "for a tensor made from that gradient (p.grad * 0.5, p.grad + noise), and trains the "
        "wrong rows for one saved before another batch's backward. Change the gradient in place "
        "(p.grad.mul_(...)) to say nothing",
        RuntimeWarning,
        stacklevel=stacklevel + 1,
    )
    return True


def passed_by(optimizer: torch.optim.Optimizer, parameter: torch.Tensor) -> bool:
    """The table trains, and another parameter of ``optimizer`` has a gradient: a backward pass
    ran since the last step (NOTE [ A gradient the table did not get ])."""
    return parameter.requires_grad and any(
        p.grad is not None
        for group in optimizer.param_groups
        for p in group["params"]
        if p is not parameter
    )


def warn_unreached(leaves: int) -> bool:
    """Warn that ``leaves`` batches were read to train since the last step and no backward pass
    gave their rows a gradient (NOTE [ A gradient the table did not get ]); True, once warned."""
    warnings.warn(
        f"an optimizer holding pipe.parameter steps, and no gradient reached the embedding "
        f"table since its last step though {leaves} batch(es) were read to train and other "
        "parameters have one: a gradient taken for model.parameters() (torch.autograd.grad, "
        "backward(inputs=...), torch.func) never reaches the table, whose gradient flows "
        "through the batch's rows (batch.rows), where nn.Embedding's weight would get its own. "
        "Take the gradient with backward() (or include batch.rows in inputs=); to leave the "
        "table out of a step on purpose, freeze it with pipe.parameter.requires_grad_(False)",
        RuntimeWarning,
        stacklevel=5,  # the program's optimizer.step()
    )
    return True
