"""Lion (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms"), multi-tensor and pure."""
from __future__ import annotations

from typing import Any, Callable, NamedTuple

import optree
import torch

from ..core.registry import register_checkpoint_type
from .base import (Optimizer, decay_hyper, hyper_values, lerp, lerp_weight, lr_hyper, make_hyper, shared_docs, TreespecCache, check_betas, check_lr, check_real, flatten_params, flatten_update,
                   host_number, init_count, lr_value, make_learning_rate, sub_scaled)
from .groups import Group, check_group_args, group_lr, make_groups, run_groups

__all__ = ["lion", "LionState"]


@register_checkpoint_type("functrain.optim.LionState")
class LionState(NamedTuple):
    """State of :func:`lion` (one buffer per param; Adam keeps two).

    Attributes:
        count: the number of updates already taken, an int64 scalar tensor (0 after ``init``).
        exp_avg: the momentum, a tree shaped like the params.
        hyper: the hyper-parameters ``update`` reads (``"lr"``, ``"beta1"``, ``"beta2"``, ``"weight_decay"``),
            0-dim float64 tensors filled by ``init`` from the constructor (:mod:`functrain.core.hyper`);
            ``None``: the constructor's.

    Example::

        >>> import torch
        >>> from functrain.optim import lion
        >>> state = lion(lr=1e-4).init({"w": torch.ones(2)})
        >>> int(state.count), state.exp_avg["w"]
        (0, tensor([0., 0.]))
    """

    count: torch.Tensor
    exp_avg: Any
    hyper: Any = None


@shared_docs
def lion(
    lr: float | Callable[[Any], Any],
    betas: tuple[float, float] = (0.9, 0.99),
    weight_decay: float = 0.0,
    *,
    weight_decay_mask: Any = None,
    lr_multipliers: Any = None,
) -> Optimizer:
    """Lion: the sign of an interpolation of momentum and gradient, with decoupled weight decay.

    Per leaf, with ``m`` the momentum (zero at first) and ``g`` the gradient::

        c = beta1 * m + (1 - beta1) * g       (the direction, before updating m)
        p = p * (1 - lr * weight_decay)       (decoupled, as AdamW)
        p = p - lr * sign(c)
        m = beta2 * m + (1 - beta2) * g

    Every element moves by exactly ``lr`` (or not at all where ``c == 0``), so Lion
    wants an lr about 3-10x smaller than AdamW's and a weight decay 3-10x larger to
    keep ``lr * weight_decay`` similar (the paper's advice). The interpolations are
    ``torch.lerp`` (one rounding each).

    Args:
        {LR}
        betas: ``(beta1, beta2)``: the interpolation of the direction and the momentum's decay,
            each in [0, 1) (default ``(0.9, 0.99)``).
        weight_decay: the decoupled decay factor >= 0 (default 0: none).
        {GROUPS}

    Returns:
        An :class:`~functrain.optim.Optimizer` whose ``init(params)`` returns :class:`LionState` and whose
        ``update(grads, state, params)`` returns ``(new_params, new_state)``.

    Raises:
        {RAISES}

    Example::

        >>> import torch
        >>> from functrain.optim import lion
        >>> opt = lion(lr=0.1)
        >>> params = {"w": torch.tensor([1.0, 1.0, 1.0])}
        >>> state = opt.init(params)
        >>> params, state = opt.update({"w": torch.tensor([3.0, -1e-6, 0.0])}, state, params)
        >>> params["w"]  # each weight moves by lr against the sign of its gradient
        tensor([0.9000, 1.1000, 1.0000])
    """
    lr = check_lr(lr)
    beta1, beta2 = check_betas(betas)
    weight_decay = check_real("weight_decay", weight_decay, lo=0.0)
    check_group_args("lion", weight_decay, weight_decay_mask, lr_multipliers)

    flatten = TreespecCache()  # the params' treespec, cached for the eager update
    # the values a user changes between runs: data in the state (LionState.hyper), not constants of the graph
    defaults = {**lr_hyper(lr), "beta1": beta1, "beta2": beta2, **decay_hyper(weight_decay)}

    def init(params: Any) -> LionState:
        leaves, spec = flatten_params(params)
        make_groups(params, weight_decay_mask, lr_multipliers)  # check the mask / multipliers now
        count = init_count(leaves)
        return LionState(count=count, exp_avg=optree.tree_unflatten(spec, [torch.zeros_like(p) for p in leaves]),
                         hyper=make_hyper(defaults, count.device))

    def update(grads: Any, state: LionState, params: Any) -> tuple[Any, LionState]:
        count = state.count
        unflatten, p, g, (m,) = flatten_update(grads, params, state.exp_avg, flatten=flatten)
        if not p:
            return params, state._replace(count=count + 1)
        # eagerly the state's values (and a scheduled lr) read as floats; traced or on a device, tensors
        h = hyper_values(state.hyper, defaults)
        beta1, beta2, weight_decay = h["beta1"], h["beta2"], h.get("weight_decay", 0.0)
        lr_base = host_number(lr_value(lr, count, h))

        def group_update(group: Group, p: list, g: list, m: list) -> tuple[list, list]:
            lr_t = group_lr(lr_base, group)
            if group.decay and (isinstance(weight_decay, torch.Tensor) or weight_decay != 0):
                p = torch._foreach_mul(p, 1 - lr_t * weight_decay)  # a tensor always decays: exact for 0
            direction = torch._foreach_sign(lerp(m, g, lerp_weight(1 - beta1, m)))
            return sub_scaled(p, direction, lr_t), lerp(m, g, lerp_weight(1 - beta2, m))

        groups = make_groups(params, weight_decay_mask, lr_multipliers, n=len(p))
        new_p, new_m = run_groups(groups, group_update, p, g, m)
        return unflatten(new_p), LionState(count=count + 1, exp_avg=unflatten(new_m), hyper=state.hyper)

    return Optimizer(init=init, update=update, learning_rate=make_learning_rate(lr, defaults),
                     per_param=weight_decay_mask is not None or lr_multipliers is not None, schedule=lr,
                     hyper=defaults)
