"""The loss contract and the micro-batch gradient: what the step's ``loss`` and ``grad`` stages run.

:func:`base_loss` calls the user's ``loss_fn`` on copies of the buffers, checks what it
returns and packs the summable ``out`` dict the later stages read. :func:`micro_grad` is
the grad stage's base, written once: the gradient comes from
:func:`functrain.core.eager.grad_with_aux` (``torch.autograd.grad`` eagerly,
``torch.func.grad_and_value`` traced). These run once per micro-batch, so they avoid tree
traversals they can prove unnecessary (an empty buffer dict, a float32 loss, ``out``
holding no tensor that needs grad): the same results, less Python per call.

Example::

    >>> import torch
    >>> from functrain.core.grad import base_loss, micro_grad
    >>> loss_fn = lambda p, b, x: (p["w"] * x).sum()
    >>> grads, out = micro_grad(lambda p, b, x: base_loss(loss_fn, p, b, x), {"w": torch.ones(2)}, {},
    ...                         torch.tensor([3.0, 4.0]))
    >>> grads["w"], out["loss"], out["denom"]
    (tensor([3., 4.]), tensor(7.), 1.0)
"""
from __future__ import annotations

from typing import Any, Callable

import optree
import torch

from . import tree as T
from .validate import BadValue
from .checks import check_loss
from .eager import grad_with_aux
from .flat import split_leaves

__all__ = ["base_loss", "micro_grad"]


def base_loss(loss_fn: Callable, params: Any, buffers: Any, batch: Any) -> tuple[torch.Tensor, dict]:
    """``loss_fn(params, copies of buffers, batch)`` checked, as ``(objective, out)``.

    ``out`` holds tensors only (what a differentiating transform may return as aux):
    ``loss`` (detached, float32), ``aux`` (detached float32 metrics), ``buffers`` (the
    copies, as the forward pass left them) and, when ``aux["num_items"]`` is given,
    ``denom`` and ``num_items`` (the float32 item count). :func:`micro_grad` adds the
    constant ``denom`` (1.0 without an item count) and ``weight`` (1.0).
    """
    # The forward pass may update buffers in place (BatchNorm statistics):
    # give it copies so that the input state is never written.
    if not (type(buffers) is dict and not buffers):
        buffers = T.tree_map(torch.clone, buffers)
    result = loss_fn(params, buffers, batch)
    if isinstance(result, tuple):
        if len(result) != 2:
            raise BadValue(f"loss_fn must return a scalar loss or (loss, aux_dict); got a tuple of {len(result)}")
        loss, aux = result
    else:
        loss, aux = result, {}
    check_loss(loss)
    if not isinstance(aux, dict):
        raise TypeError(f"loss_fn's aux must be a dict of tensors (metrics); got {type(aux).__name__}")
    num_items = None
    if aux:
        aux = dict(aux)
        num_items = aux.pop("num_items", None)
        aux = {k: torch.as_tensor(v).detach().to(torch.float32) for k, v in aux.items()}
    else:
        aux = {}  # never the caller's own dict
    value = loss.detach()
    out = {"loss": value if value.dtype is torch.float32 else value.to(torch.float32), "aux": aux, "buffers": buffers}
    if num_items is not None:  # a sum over items: the denominator is their count (else micro_grad's 1.0)
        out["denom"] = out["num_items"] = torch.as_tensor(num_items, device=loss.device).to(torch.float32).detach()
    return loss, out


def micro_grad(loss_fn: Callable, params: Any, buffers: Any, batch: Any,
               flatten: Callable = optree.tree_flatten) -> tuple[Any, dict]:
    """The grad stage's base: the gradient of one micro-batch's objective w.r.t. ``params``, and its ``out``.

    ``loss_fn(params, buffers, batch) -> (objective, out)`` is the loss stage's result
    (:func:`base_loss`, wrapped by the transforms' ``wrap_loss``); ``out`` holds tensors only.
    The gradient is :func:`functrain.core.eager.grad_with_aux` over the params' leaves (for
    :class:`~functrain.FlatParams` the per-leaf views, and the gradients packed into one flat
    buffer per dtype); ``flatten`` flattens a plain params tree (the step passes its
    :class:`functrain.core.eager.TreespecCache`). The returned ``out`` adds the per-micro-batch
    constants the later stages sum: ``denom`` 1.0 (unless the loss counts items) and ``weight``
    1.0, Python numbers, so a mean loss's graph divides by a constant or not at all.
    """
    leaves, as_params, as_grads = split_leaves(params, flatten)
    grads, out = grad_with_aux(lambda ls, b, x: loss_fn(as_params(ls), b, x), leaves, buffers, batch)
    return as_grads(grads), {"denom": 1.0, "weight": 1.0, **out}
