"""The loss contract and the eager gradient: what the step's ``loss`` and ``grad`` stages run per micro-batch.

:func:`base_loss` calls the user's ``loss_fn`` on copies of the buffers, checks what it
returns and packs the summable ``out`` dict the later stages read. :func:`autograd_grad`
is the eager gradient (``torch.autograd.grad``); traced, the step uses
``torch.func.grad_and_value`` over :func:`tensor_aux` instead. These run once per
micro-batch, so they avoid tree traversals they can prove unnecessary (an empty buffer
dict, a float32 loss, ``out`` holding no tensor that needs grad): the same results, less
Python per call.

Example::

    >>> import torch
    >>> from functrain.core.grad import autograd_grad, base_loss
    >>> loss_fn = lambda p, b, x: (p["w"] * x).sum()
    >>> grads, out = autograd_grad(lambda p, b, x: base_loss(loss_fn, p, b, x), {"w": torch.ones(2)}, {},
    ...                            torch.tensor([3.0, 4.0]))
    >>> grads["w"], out["loss"]
    (tensor([3., 4.]), tensor(7.))
"""
from __future__ import annotations

from typing import Any, Callable

import optree
import torch

from . import tree as T
from .validate import BadValue
from .checks import check_loss
from .flat import FlatParams, split_leaves

__all__ = ["base_loss", "autograd_grad", "tensor_aux", "has_grad"]


def base_loss(loss_fn: Callable, params: Any, buffers: Any, batch: Any) -> tuple[torch.Tensor, dict]:
    """``loss_fn(params, copies of buffers, batch)`` checked, as ``(objective, out)``.

    ``out`` holds ``loss`` (detached, float32), ``denom`` (1.0, or the float32 item count
    when ``aux["num_items"]`` is given), ``aux`` (detached float32 metrics), ``weight``
    (1.0), ``buffers`` (the copies, as the forward pass left them) and ``num_items`` when
    given.
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
    # Denominators known before the step runs stay Python numbers (a mean loss counts 1 per
    # micro-batch): the graph then divides by a constant, or not at all.
    if num_items is None:
        denom: Any = 1.0
    else:
        denom = torch.as_tensor(num_items, device=loss.device).to(torch.float32).detach()
    value = loss.detach()
    out = {
        "loss": value if value.dtype is torch.float32 else value.to(torch.float32),
        "denom": denom,
        "aux": aux,
        "weight": 1.0,
        "buffers": buffers,
    }
    if num_items is not None:
        out["num_items"] = out["denom"]
    return loss, out


def tensor_aux(loss_fn: Callable) -> Callable:
    """``loss_fn`` with the per-micro-batch constants (``denom``/``weight`` of 1.0) left out of its
    aux output: torch.func transforms return tensors only; the grad stage puts them back."""

    def fn(params, buffers, batch):
        objective, out = loss_fn(params, buffers, batch)
        return objective, {k: v for k, v in out.items() if not isinstance(v, float)}

    return fn


def autograd_grad(loss_fn: Callable, params: Any, buffers: Any, batch: Any,
                  flatten: Callable = optree.tree_flatten) -> tuple[Any, dict]:
    """The eager path of the grad stage: ``torch.autograd.grad``, the same math as
    ``torch.func.grad_and_value`` at a fraction of its per-call Python cost. ``flatten``
    flattens ``params`` (the step passes its :class:`functrain.core.eager.FlatDict`)."""
    if isinstance(params, FlatParams):  # a flat state: differentiate the per-leaf views, pack the gradients
        leaves, as_params, as_grads = split_leaves(params)
    else:
        leaves, spec = flatten(params)
        as_params = as_grads = lambda ls: optree.tree_unflatten(spec, ls)  # noqa: E731
    live = [p.detach().requires_grad_(True) for p in leaves]
    if torch.is_grad_enabled():
        objective, out = loss_fn(as_params(live), buffers, batch)
        grads = _grad(objective, live)
    else:
        with torch.enable_grad():
            objective, out = loss_fn(as_params(live), buffers, batch)
            grads = _grad(objective, live)
    if not all(map(torch.is_tensor, grads)):  # an unused param: a zero gradient
        if _reentrant_in_graph(objective):  # ... unless torch's reentrant checkpoint hid it from autograd.grad
            raise RuntimeError(_REENTRANT_MSG)
        grads = [torch.zeros_like(p) if g is None else g for p, g in zip(leaves, grads)]
    if has_grad(out):
        out = optree.tree_map(lambda t: t.detach() if torch.is_tensor(t) else t, out)
    return as_grads(grads), out


_REENTRANT_MSG = ("the loss calls torch.utils.checkpoint.checkpoint(use_reentrant=True), which only runs under "
                  "loss.backward(): its parameters get no gradient from torch.autograd.grad (functrain's eager "
                  "gradient) and it cannot run under torch.func (the compiled step's). Mark the block with "
                  "ft.remat(module) or call ft.remat(fn)(*args) instead: the same recomputation, eager and compiled")


def _grad(objective: torch.Tensor, live: list) -> tuple:
    try:
        return torch.autograd.grad(objective, live, allow_unused=True)
    except RuntimeError as e:
        if "with .grad()" in str(e) and "checkpoint" in str(e).lower():  # torch's reentrant checkpoint refuses
            raise RuntimeError(_REENTRANT_MSG) from e
        raise


def _reentrant_in_graph(objective: torch.Tensor) -> bool:
    """Whether the autograd graph of ``objective`` holds torch's reentrant checkpoint (a walk of the graph, done
    only when some parameter got no gradient)."""
    seen: set = set()
    todo = [objective.grad_fn]
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if type(node).__name__ == "CheckpointFunctionBackward":
            return True
        todo.extend(n for n, _ in node.next_functions)
    return False


def has_grad(tree: Any) -> bool:
    """Does a tensor in ``tree`` require grad? (dicts are walked directly: the grad stage's ``out``)"""
    if isinstance(tree, torch.Tensor):
        return tree.requires_grad
    if type(tree) is dict:
        for v in tree.values():
            if isinstance(v, torch.Tensor):
                if v.requires_grad:
                    return True
            elif isinstance(v, float) or (type(v) is dict and not v):
                continue
            elif has_grad(v):
                return True
        return False
    if tree is None or isinstance(tree, (float, int)):
        return False
    return any(t.requires_grad for t in optree.tree_leaves(tree) if isinstance(t, torch.Tensor))
