"""Stochastic gradient descent matching ``torch.optim.SGD`` (multi-tensor, pure)."""
from __future__ import annotations

from typing import Any, Callable, NamedTuple

import optree
import torch

from ..core.registry import register_checkpoint_type
from .base import (Optimizer, add_scaled, decay_hyper, hyper_values, lr_hyper, make_hyper, shared_docs, TreespecCache, check_lr, check_real, flatten_params, flatten_update, host_number,
                   init_count, lr_value, make_learning_rate, select, sub_scaled)
from .groups import Group, check_group_args, group_lr, make_groups, run_groups

__all__ = ["sgd", "SGDState"]


@register_checkpoint_type("functrain.optim.SGDState")
class SGDState(NamedTuple):
    """State of :func:`sgd`.

    Attributes:
        count: the number of updates already taken, an int64 scalar tensor (0 after ``init``).
        momentum_buffer: the momentum buffers, a tree shaped like the params, or ``None`` when
            ``momentum=0``.
        hyper: the hyper-parameters ``update`` reads (``"lr"``, ``"weight_decay"``, and with momentum
            ``"momentum"`` and ``"dampening"``), 0-dim float64 tensors filled by ``init`` from the constructor
            (:mod:`functrain.core.hyper`); ``None``: the constructor's. Whether there is momentum (and
            ``nesterov``) is the step's structure, not a value.

    Example::

        >>> import torch
        >>> from functrain.optim import sgd
        >>> state = sgd(lr=0.1, momentum=0.9).init({"w": torch.ones(2)})
        >>> int(state.count), state.momentum_buffer["w"]
        (0, tensor([0., 0.]))
    """

    count: torch.Tensor
    momentum_buffer: Any
    hyper: Any = None


@shared_docs
def sgd(
    lr: float | Callable[[Any], Any],
    momentum: float = 0.0,
    nesterov: bool = False,
    weight_decay: float = 0.0,
    dampening: float = 0.0,
    *,
    weight_decay_mask: Any = None,
    lr_multipliers: Any = None,
) -> Optimizer:
    """SGD with optional (Nesterov) momentum and L2 weight decay, like ``torch.optim.SGD``.

    Per leaf, with ``g`` the gradient (plus ``weight_decay * p``)::

        buf = g                                     on the first update
        buf = momentum * buf + (1 - dampening) * g  afterwards
        d   = g + momentum * buf if nesterov else buf   (d = g without momentum)
        p   = p - lr * d

    Args:
        {LR}
        momentum: the momentum factor, a float >= 0 (default 0: no momentum, no buffers).
        nesterov: a bool: Nesterov momentum (default ``False``); needs ``momentum > 0`` and ``dampening == 0``.
        weight_decay: the L2 factor >= 0 added to the gradient (default 0: none).
        dampening: a float in [0, 1] damping the gradient in the momentum buffer (default 0).
        {GROUPS}

    Returns:
        An :class:`~functrain.optim.Optimizer` whose ``init(params)`` returns :class:`SGDState` and whose
        ``update(grads, state, params)`` returns ``(new_params, new_state)``.

    Raises:
        {RAISES}
        TypeError: ``nesterov`` is not a bool.
        ValueError: ``nesterov=True`` without ``momentum > 0`` and ``dampening == 0``.

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
    check_group_args("sgd", weight_decay, weight_decay_mask, lr_multipliers)

    flatten = TreespecCache()  # the params' treespec, cached for the eager update
    # the values a user changes between runs: data in the state (SGDState.hyper), not constants of the graph
    defaults = {**lr_hyper(lr), **decay_hyper(weight_decay)}
    if momentum != 0:  # without momentum there is no buffer: a structure, not a value
        defaults.update(momentum=momentum, dampening=dampening)

    def init(params: Any) -> SGDState:
        leaves, spec = flatten_params(params)
        make_groups(params, weight_decay_mask, lr_multipliers)  # check the mask / multipliers now
        buf = None
        if momentum != 0:
            buf = optree.tree_unflatten(spec, [torch.zeros_like(p) for p in leaves])
        count = init_count(leaves)
        return SGDState(count=count, momentum_buffer=buf, hyper=make_hyper(defaults, count.device))

    def update(grads: Any, state: SGDState, params: Any) -> tuple[Any, SGDState]:
        count = state.count
        bufs_in = [state.momentum_buffer] if momentum != 0 else []
        unflatten, p, g, trees = flatten_update(grads, params, *bufs_in, flatten=flatten)
        if not p:
            return params, state._replace(count=count + 1)
        # eagerly the state's values (and a scheduled lr) read as floats, torch.optim's arithmetic; else tensors
        h = hyper_values(state.hyper, defaults)
        lr_base = host_number(lr_value(lr, count, h))
        wd = h.get("weight_decay", 0.0)

        def group_update(group: Group, p: list, g: list, *bufs: list) -> tuple[list, ...]:
            # One torch.optim param group: its own lr (base * multiplier) and weight decay (a tensor always
            # decays: exact for 0, so one graph serves both).
            if group.decay and (isinstance(wd, torch.Tensor) or wd != 0):
                g = add_scaled(g, p, wd)
            new_buf = []
            if momentum != 0:
                mom, damp = h["momentum"], h["dampening"]
                # The buffers start at zero, so momentum * 0 + 1 * g == g reproduces torch's
                # "first buffer = grad" exactly; with dampening the first step needs a select.
                summed = add_scaled(torch._foreach_mul(bufs[0], mom), g, 1.0 - damp)
                buf = summed
                if isinstance(damp, torch.Tensor) or damp != 0:  # torch.optim's first buffer is a copy of the gradient
                    buf = select(host_number(count) == 0, g, lambda: summed)
                new_buf = [buf]
                d = add_scaled(g, buf, mom) if nesterov else buf
            else:
                d = g
            return (sub_scaled(p, d, group_lr(lr_base, group)), *new_buf)  # torch's p.add(d, alpha=-lr)

        groups = make_groups(params, weight_decay_mask, lr_multipliers, n=len(p))
        new_p, *new_buf = run_groups(groups, group_update, p, g, *trees)
        new_state = SGDState(count=count + 1, momentum_buffer=unflatten(new_buf[0]) if new_buf else None,
                             hyper=state.hyper)
        return unflatten(new_p), new_state

    return Optimizer(init=init, update=update, learning_rate=make_learning_rate(lr, defaults),
                     per_param=weight_decay_mask is not None or lr_multipliers is not None, schedule=lr,
                     hyper=defaults)
