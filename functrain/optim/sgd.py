"""Stochastic gradient descent matching ``torch.optim.SGD`` (multi-tensor, pure)."""
from __future__ import annotations

from typing import Any, Callable, NamedTuple

import optree
import torch

from ..registry import register_checkpoint_type
from .base import (
    Optimizer,
    check_lr,
    check_real,
    flatten_params,
    flatten_update,
    init_count,
    lr_value,
    make_learning_rate,
)

__all__ = ["sgd", "SGDState"]


@register_checkpoint_type("functrain.optim.SGDState")
class SGDState(NamedTuple):
    """State of :func:`sgd`: the update ``count`` (int64 scalar) and the momentum
    buffers (a tree shaped like the params, or ``None`` without momentum).

    Example::

        >>> import torch
        >>> from functrain.optim import sgd
        >>> state = sgd(lr=0.1, momentum=0.9).init({"w": torch.ones(2)})
        >>> int(state.count), state.momentum_buffer["w"]
        (0, tensor([0., 0.]))
    """

    count: torch.Tensor
    momentum_buffer: Any


def sgd(
    lr: float | Callable[[Any], Any],
    momentum: float = 0.0,
    nesterov: bool = False,
    weight_decay: float = 0.0,
    dampening: float = 0.0,
) -> Optimizer:
    """SGD with optional (Nesterov) momentum and L2 weight decay, like ``torch.optim.SGD``.

    Per leaf, with ``g`` the gradient (plus ``weight_decay * p``)::

        buf = g                                     on the first update
        buf = momentum * buf + (1 - dampening) * g  afterwards
        d   = g + momentum * buf if nesterov else buf   (d = g without momentum)
        p   = p - lr * d

    ``lr`` is a float or a schedule ``callable(count) -> lr`` (see
    :mod:`functrain.optim.schedules`); ``count`` is the number of updates taken.

    Example::

        >>> import torch
        >>> from functrain.optim import sgd
        >>> opt = sgd(lr=0.5, momentum=0.9)
        >>> params = {"w": torch.tensor([1.0])}
        >>> state = opt.init(params)
        >>> for _ in range(2):
        ...     params, state = opt.update({"w": torch.tensor([1.0])}, state, params)
        >>> params["w"]  # 1 - 0.5*1 - 0.5*1.9
        tensor([-0.4500])
    """
    lr = check_lr(lr)
    momentum = check_real("momentum", momentum, lo=0.0)
    weight_decay = check_real("weight_decay", weight_decay, lo=0.0)
    dampening = check_real("dampening", dampening, lo=0.0, hi=1.0)
    if not isinstance(nesterov, bool):
        raise TypeError(f"nesterov must be a bool; got {nesterov!r} ({type(nesterov).__name__})")
    if nesterov and (momentum <= 0 or dampening != 0):
        raise ValueError(
            f"nesterov=True requires momentum > 0 and dampening == 0; got momentum={momentum!r}, "
            f"dampening={dampening!r}"
        )

    def init(params: Any) -> SGDState:
        leaves, spec = flatten_params(params)
        buf = None
        if momentum != 0:
            buf = optree.tree_unflatten(spec, [torch.zeros_like(p) for p in leaves])
        return SGDState(count=init_count(leaves), momentum_buffer=buf)

    def update(grads: Any, state: SGDState, params: Any) -> tuple[Any, SGDState]:
        count = state.count
        bufs_in = [state.momentum_buffer] if momentum != 0 else []
        unflatten, p, g, trees = flatten_update(grads, params, *bufs_in)
        if not p:
            return params, state._replace(count=count + 1)
        if weight_decay != 0:
            g = torch._foreach_add(g, p, alpha=weight_decay)
        new_buf_tree = None
        if momentum != 0:
            # The buffers start at zero, so momentum * 0 + 1 * g == g reproduces torch's
            # "first buffer = grad" exactly; with dampening the first step needs a select.
            buf = torch._foreach_mul(trees[0], momentum)
            torch._foreach_add_(buf, g, alpha=1.0 - dampening)
            if dampening != 0:
                first = count == 0
                buf = [torch.where(first, gi, bi) for gi, bi in zip(g, buf)]
            new_buf_tree = unflatten(buf)
            d = torch._foreach_add(g, buf, alpha=momentum) if nesterov else buf
        else:
            d = g
        lr_t = lr_value(lr, count)
        if isinstance(lr_t, torch.Tensor):
            # p + (-1 * d) * lr rounds once like torch's p.add(d, alpha=-lr) (a fused
            # multiply-add on CPU); a separate mul then add would round twice.
            new_p = torch._foreach_addcmul(p, d, [lr_t] * len(d), value=-1)
        else:
            new_p = torch._foreach_add(p, d, alpha=-lr_t)
        new_state = SGDState(count=count + 1, momentum_buffer=new_buf_tree)
        return unflatten(new_p), new_state

    return Optimizer(init=init, update=update, learning_rate=make_learning_rate(lr))
