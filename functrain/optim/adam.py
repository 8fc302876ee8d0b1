"""Adam and AdamW matching ``torch.optim.Adam`` / ``torch.optim.AdamW`` (multi-tensor, pure)."""
from __future__ import annotations

from typing import Any, Callable, NamedTuple

import optree
import torch

from ..core.registry import register_checkpoint_type
from .base import (Optimizer, add_scalar_, decay_hyper, shared_docs, TreespecCache, check_betas, check_lr, check_real, double, flatten_params, flatten_update,
                   host_number, hyper_values, init_count, lerp, lerp_weight, lr_hyper, lr_value, make_hyper, make_learning_rate,
                   per_step, scaled_sq_into, sub_scaled_ratio)
from .groups import Group, check_group_args, group_lr, make_groups, run_groups

__all__ = ["adam", "adamw", "AdamState"]


@register_checkpoint_type("functrain.optim.AdamState")
class AdamState(NamedTuple):
    """State of :func:`adam` / :func:`adamw` (torch.optim's names).

    Attributes:
        count: the number of updates already taken, an int64 scalar tensor (0 after ``init``).
        exp_avg: the first moment estimate, a tree shaped like the params.
        exp_avg_sq: the second moment estimate (of the squared gradient), a tree shaped like the params.
        hyper: the hyper-parameters ``update`` reads, ``{"lr", "beta1", "beta2", "eps", "weight_decay"}``, each a
            0-dim float64 tensor (``"lr"``: a schedule's constants, ``{kind: {name: tensor}}``), filled by ``init``
            from the constructor (:mod:`functrain.core.hyper`; change them with :func:`functrain.set_hyper`).
            ``None`` (a state saved before they were data): the constructor's values.

    Example::

        >>> import torch, functrain as ft
        >>> from functrain.optim import adam
        >>> state = adam(lr=1e-3).init({"w": torch.ones(2)})
        >>> int(state.count), state.exp_avg["w"], state.exp_avg_sq["w"], float(ft.get_hyper(state)["beta2"])
        (0, tensor([0., 0.]), tensor([0., 0.]), 0.999)
    """

    count: torch.Tensor
    exp_avg: Any
    exp_avg_sq: Any
    hyper: Any = None


def _adam(lr: Any, betas: Any, eps: Any, weight_decay: Any, decoupled: bool, weight_decay_mask: Any,
          lr_multipliers: Any, owner: str) -> Optimizer:
    lr = check_lr(lr)
    beta1, beta2 = check_betas(betas)
    eps = check_real("eps", eps, lo=0.0)
    weight_decay = check_real("weight_decay", weight_decay, lo=0.0)
    check_group_args(owner, weight_decay, weight_decay_mask, lr_multipliers)

    flatten = TreespecCache()  # the params' treespec, cached for the eager update
    # the values a user changes between runs: data in the state (AdamState.hyper), not constants of the graph
    defaults = {**lr_hyper(lr), "beta1": beta1, "beta2": beta2, "eps": eps, **decay_hyper(weight_decay)}

    def init(params: Any) -> AdamState:
        leaves, spec = flatten_params(params)
        make_groups(params, weight_decay_mask, lr_multipliers)  # check the mask / multipliers now
        zeros = lambda: optree.tree_unflatten(spec, [torch.zeros_like(p) for p in leaves])  # noqa: E731
        count = init_count(leaves)
        return AdamState(count=count, exp_avg=zeros(), exp_avg_sq=zeros(), hyper=make_hyper(defaults, count.device))

    def update(grads: Any, state: AdamState, params: Any) -> tuple[Any, AdamState]:
        count = state.count
        unflatten, p, g, (m, v) = flatten_update(grads, params, state.exp_avg, state.exp_avg_sq, flatten=flatten)
        if not p:
            return params, state._replace(count=count + 1)
        # torch.optim's scalars, in its order: Python floats eagerly (host_number: a CPU counter, the state's
        # hyper-parameters and a scheduled lr read on the host), float64 tensors traced or on a device, computed
        # once per step
        h = hyper_values(state.hyper, defaults)
        beta1, beta2, eps, weight_decay = h["beta1"], h["beta2"], h["eps"], h.get("weight_decay", 0.0)
        lr_base = host_number(lr_value(lr, count, h))
        step = double(host_number(count) + 1)
        bias_correction1, bias_correction2_sqrt = per_step(1 - beta1**step, (1 - beta2**step) ** 0.5)

        def group_update(group: Group, p: list, g: list, m: list, v: list) -> tuple[list, list, list]:
            # One torch.optim param group: its own lr (base * multiplier) and weight decay.
            lr_t = group_lr(lr_base, group)
            decayed, m, v = _decay_and_moments(group, p, g, m, v, lr_t, beta1, beta2, weight_decay, decoupled)
            step_size, = per_step(lr_t / bias_correction1)
            # p - step_size * m / (sqrt(v) / bias_correction2_sqrt + eps), in torch's order
            denom = torch._foreach_sqrt(v)
            torch._foreach_div_(denom, bias_correction2_sqrt)
            add_scalar_(denom, eps)
            if decayed is None:
                return sub_scaled_ratio(p, m, denom, step_size), m, v
            return sub_scaled_ratio(decayed, m, denom, step_size, owned=True), m, v  # decayed: this update's

        groups = make_groups(params, weight_decay_mask, lr_multipliers, n=len(p))
        new_p, m, v = run_groups(groups, group_update, p, g, m, v)
        new_state = AdamState(
            count=count + 1,
            exp_avg=unflatten(m),
            exp_avg_sq=unflatten(v),
            hyper=state.hyper,
        )
        return unflatten(new_p), new_state

    return Optimizer(init=init, update=update, learning_rate=make_learning_rate(lr, defaults),
                     per_param=weight_decay_mask is not None or lr_multipliers is not None, schedule=lr,
                     hyper=defaults)


def _decay_and_moments(group: Group, p: list, g: list, m: list, v: list, lr_t: Any, beta1: Any, beta2: Any,
                       weight_decay: Any, decoupled: bool) -> tuple[list | None, list, list]:
    """Weight decay and both moment updates, in torch.optim's order; returns ``(decayed params or None, m, v)``
    (coupled decay folds into the gradient, so the params come back ``None``: untouched).

    A number (eagerly) is torch.optim's float arithmetic, a decay of 0 skipped on the host; a tensor (a traced
    or device state's value) always decays, by ``wd * p``, which is exact for ``wd = 0`` (so a graph built with
    0 serves a run with decay, and inductor fuses it into the update's one pass)."""
    decayed = None
    if group.decay and (isinstance(weight_decay, torch.Tensor) or weight_decay != 0):
        if decoupled:
            decayed = torch._foreach_mul(p, 1 - lr_t * weight_decay)
        elif isinstance(weight_decay, torch.Tensor):  # add(alpha=) takes a number only
            g = torch._foreach_add(g, torch._foreach_mul(p, weight_decay))
        else:
            g = torch._foreach_add(g, p, alpha=weight_decay)
    m = lerp(m, g, lerp_weight(1 - beta1, m))
    v = torch._foreach_mul(v, beta2)
    scaled_sq_into(v, g, 1 - beta2)
    return decayed, m, v


@shared_docs
def adam(
    lr: float | Callable[[Any], Any],
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    *,
    weight_decay_mask: Any = None,
    lr_multipliers: Any = None,
) -> Optimizer:
    """Adam with L2 weight decay (added to the gradient), like ``torch.optim.Adam``.

    ``weight_decay_mask`` and ``lr_multipliers`` play the role of torch.optim's param groups;
    see :mod:`functrain.optim.groups`.

    Args:
        {LR}
        betas: ``(beta1, beta2)``, the decay rates of the two moment estimates, each in [0, 1)
            (default ``(0.9, 0.999)``).
        eps: a float >= 0 added to the denominator (default ``1e-8``).
        weight_decay: the L2 factor >= 0 added to the gradient as ``weight_decay * p`` (default 0: none).
        {GROUPS}

    Returns:
        An :class:`~functrain.optim.Optimizer` whose ``init(params)`` returns :class:`AdamState` and whose
        ``update(grads, state, params)`` returns ``(new_params, new_state)``.

    Raises:
        {RAISES}

    Example::

        >>> import torch
        >>> from functrain.optim import adam
        >>> opt = adam(lr=0.1)
        >>> params = {"w": torch.tensor([1.0, -1.0])}
        >>> state = opt.init(params)
        >>> params, state = opt.update({"w": torch.tensor([2.0, -3.0])}, state, params)
        >>> params["w"]  # the first Adam step moves each weight by ~lr
        tensor([ 0.9000, -0.9000])
    """
    return _adam(lr, betas, eps, weight_decay, False, weight_decay_mask, lr_multipliers, "adam")


@shared_docs
def adamw(
    lr: float | Callable[[Any], Any],
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 0.01,
    *,
    weight_decay_mask: Any = None,
    lr_multipliers: Any = None,
) -> Optimizer:
    """AdamW: Adam with decoupled weight decay ``p *= 1 - lr * weight_decay``, like ``torch.optim.AdamW``.

    A leaf's lr is ``lr * multiplier``, also in the decoupled decay ``1 - lr * wd``, as in a torch
    param group with that lr. ``learning_rate(state)`` reports the base lr.

    Args:
        {LR}
        betas: ``(beta1, beta2)``, the decay rates of the two moment estimates, each in [0, 1)
            (default ``(0.9, 0.999)``).
        eps: a float >= 0 added to the denominator (default ``1e-8``).
        weight_decay: the decoupled decay factor >= 0 (default ``0.01``, torch.optim.AdamW's).
        {GROUPS}

    Returns:
        An :class:`~functrain.optim.Optimizer` whose ``init(params)`` returns :class:`AdamState` and whose
        ``update(grads, state, params)`` returns ``(new_params, new_state)``.

    Raises:
        {RAISES}

    Example::

        >>> import torch
        >>> from functrain.optim import adamw, schedules
        >>> opt = adamw(lr=schedules.warmup_cosine(1e-3, warmup_steps=10, total_steps=100))
        >>> params = {"w": torch.ones(3)}
        >>> state = opt.init(params)
        >>> float(opt.learning_rate(state))  # warmup starts at 0
        0.0
        >>> params, state = opt.update({"w": torch.ones(3)}, state, params)
        >>> float(opt.learning_rate(state))
        0.0001
        >>> from functrain.optim import masks
        >>> opt = adamw(1e-3, weight_decay=0.1, weight_decay_mask=masks.no_decay_bias_and_norm,
        ...             lr_multipliers=lambda name, p: 10.0 if name.startswith("head") else 1.0)
    """
    return _adam(lr, betas, eps, weight_decay, True, weight_decay_mask, lr_multipliers, "adamw")
