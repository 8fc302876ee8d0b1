"""Schedule-free AdamW (Defazio et al. 2024) matching ``schedulefree.AdamWScheduleFree`` (pure, multi-tensor).

Schedule-free keeps two sequences per parameter: ``z``, the base SGD-like iterate, and
``x``, a weighted running average of ``z``; gradients are taken at the interpolation
``y = (1 - beta1) * z + beta1 * x``. As in the ``schedulefree`` package's ``train()``
mode, the params of the state *are* ``y`` and the state holds ``z``; ``x`` (the weights
to evaluate and to ship) is ``y`` moved towards ``z``: :func:`eval_params`
(``ft.optim.eval_params(step, state)``), what the package's ``optimizer.eval()`` writes
into the params. The per-step scalars (the warmup factor, the running ``lr_max`` and
``weight_sum`` of the average's weights) are the package's Python formulas; ``weight_sum``
and ``lr_max`` live in the state as float64 scalars.

Eagerly on the CPU the update is the package's foreach path op for op, so the params,
``z`` and ``exp_avg_sq`` are bitwise equal to it (``tests/optim/test_optim_torch.py``);
traced or on a device the scalars are float64 tensors and ``y``'s step is a fused
multiply-add, so results agree to float rounding.
"""
from __future__ import annotations

from typing import Any, Callable, NamedTuple

import optree
import torch

from ..core.registry import register_checkpoint_type
from .base import (Optimizer, add_scalar_, add_scaled, decay_hyper, hyper_values, lerp, lerp_weight, lr_hyper, make_hyper,
                   scaled_sq_into, TreespecCache, check_betas, check_lr, check_real, check_steps, flatten_params,
                   flatten_update, host_number, init_count, lr_value, make_learning_rate, per_step, sub_scaled)

__all__ = ["adamw_schedulefree", "ScheduleFreeState"]


@register_checkpoint_type("functrain.optim.ScheduleFreeState")
class ScheduleFreeState(NamedTuple):
    """State of :func:`adamw_schedulefree` (the ``schedulefree`` package's names).

    Attributes:
        count: the number of updates already taken (the package's ``k``), an int64 scalar tensor.
        z: the base iterate, a tree shaped like the params (a copy of them after ``init``).
        exp_avg_sq: the second moment estimate, a tree shaped like the params.
        weight_sum: the sum of the averaging weights so far, a float64 scalar tensor.
        lr_max: the largest (warmed-up) lr so far, a float64 scalar tensor (``-1`` after ``init``).
        hyper: the hyper-parameters ``update`` reads (``"lr"``, ``"beta1"``, ``"beta2"``, ``"eps"``,
            ``"weight_decay"``, ``"warmup_steps"``, ``"r"``, ``"weight_lr_power"``), 0-dim float64 tensors filled
            by ``init`` (:mod:`functrain.core.hyper`); ``None``: the constructor's.

    Example::

        >>> import torch
        >>> from functrain.optim import adamw_schedulefree
        >>> state = adamw_schedulefree(lr=1e-3).init({"w": torch.ones(2)})
        >>> int(state.count), state.z["w"], float(state.weight_sum), float(state.lr_max)
        (0, tensor([1., 1.]), 0.0, -1.0)
    """

    count: torch.Tensor
    z: Any
    exp_avg_sq: Any
    weight_sum: torch.Tensor
    lr_max: torch.Tensor
    hyper: Any = None


def _scalars(k: Any, lr: Any, weight_sum: Any, lr_max: Any, beta2: Any, warmup_steps: Any, r: Any,
             weight_lr_power: Any) -> tuple:
    """The package's per-step scalars: ``(lr, bias_correction2, ckp1, weight_sum, lr_max)``.

    Python numbers eagerly (its formulas, in its order); float64 tensors when traced."""
    values = (k, lr, weight_sum, lr_max, beta2, warmup_steps, r, weight_lr_power)
    if not any(isinstance(x, torch.Tensor) for x in values):
        sched = (k + 1) / warmup_steps if k < warmup_steps else 1.0
        bias_correction2 = 1 - beta2 ** (k + 1)
        lr = lr * sched
        lr_max = max(lr, lr_max)
        weight = ((k + 1) ** r) * (lr_max ** weight_lr_power)
        weight_sum = weight_sum + weight
        ckp1 = weight / weight_sum if weight_sum != 0 else 0
        return lr, bias_correction2, ckp1, weight_sum, lr_max
    device = next(x.device for x in values if isinstance(x, torch.Tensor))
    f64 = lambda x: torch.as_tensor(x, dtype=torch.float64, device=device)  # noqa: E731
    k1 = f64(k) + 1
    sched = torch.where(k1 <= warmup_steps, k1 / f64(warmup_steps).clamp(min=1), f64(1.0))
    bias_correction2 = 1 - torch.pow(f64(beta2), k1)
    lr = f64(lr) * sched
    lr_max = torch.maximum(lr, f64(lr_max))
    weight = torch.pow(k1, r) * torch.pow(lr_max, weight_lr_power)
    weight_sum = f64(weight_sum) + weight
    ckp1 = torch.where(weight_sum != 0, weight / torch.where(weight_sum != 0, weight_sum, f64(1.0)), f64(0.0))
    return (*per_step(lr, bias_correction2, ckp1), weight_sum, lr_max)


def adamw_schedulefree(
    lr: float | Callable[[Any], Any] = 0.0025,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    warmup_steps: int = 0,
    r: float = 0.0,
    weight_lr_power: float = 2.0,
) -> Optimizer:
    """Schedule-free AdamW, like ``schedulefree.AdamWScheduleFree`` in its ``train()`` mode.

    No lr schedule is needed (a linear warmup is built in); evaluate with the averaged
    weights :func:`eval_params` returns. Per leaf, with ``g`` the gradient at ``y`` (the params)::

        v     = beta2 * v + (1 - beta2) * g * g
        g'    = g / (sqrt(v / (1 - beta2^(k+1))) + eps) + weight_decay * y
        y     = lerp(y, z, ckp1) + lr * (beta1 * (1 - ckp1) - 1) * g'
        z     = z - lr * g'

    with ``lr`` warmed up linearly over ``warmup_steps`` and ``ckp1`` the weight of this
    step in the average (``lr_max ** weight_lr_power * (k+1) ** r`` over their sum).

    Args:
        lr: the learning rate, a float >= 0 or a schedule ``callable(count) -> lr`` (default 0.0025).
        betas: ``(beta1, beta2)`` in [0, 1): the interpolation and the second-moment decay
            (default ``(0.9, 0.999)``).
        eps: a float >= 0 added to the denominator (default 1e-8).
        weight_decay: decay >= 0 added to the normalised gradient at ``y`` (default 0).
        warmup_steps: linear lr warmup, an int >= 0 (default 0).
        r: the polynomial weighting power of the average, a float >= 0 (default 0).
        weight_lr_power: the power of ``lr_max`` in the average's weights, a float >= 0 (default 2).

    Returns:
        An :class:`~functrain.optim.Optimizer` whose ``init(params)`` returns :class:`ScheduleFreeState`,
        with ``eval_params`` set (the weights ``x``).

    Raises:
        BadValue: (a ``TypeError`` and a ``ValueError``) for an argument out of range, naming it.
        ValueError: ``beta1 == 0`` (the eval weights ``x`` would divide by it).

    Example::

        >>> import torch
        >>> from functrain.optim import adamw_schedulefree
        >>> opt = adamw_schedulefree(lr=0.1)
        >>> params = {"w": torch.tensor([1.0, -1.0])}
        >>> state = opt.init(params)
        >>> for g in ([2.0, -3.0], [1.0, 1.0]):
        ...     params, state = opt.update({"w": torch.tensor(g)}, state, params)
        >>> params["w"], state.z["w"]            # y (the params, where gradients are taken) and z
        (tensor([ 0.8652, -0.9246]), tensor([ 0.8367, -0.9447]))
        >>> opt.eval_params(params, state)["w"]   # x, the average: the weights to evaluate
        tensor([ 0.8684, -0.9224])
    """
    lr = check_lr(lr)
    beta1, beta2 = check_betas(betas)
    if beta1 == 0:
        raise ValueError("adamw_schedulefree: betas[0] must be > 0 (the eval weights x = lerp(y, z, 1 - 1/beta1)); "
                         "got 0.0")
    eps = check_real("eps", eps, lo=0.0)
    weight_decay = check_real("weight_decay", weight_decay, lo=0.0)
    warmup_steps = check_steps("warmup_steps", warmup_steps)
    r = check_real("r", r, lo=0.0)
    weight_lr_power = check_real("weight_lr_power", weight_lr_power, lo=0.0)
    flatten = TreespecCache()
    # the values a user changes between runs: data in the state (ScheduleFreeState.hyper), not graph constants
    defaults = {**lr_hyper(lr), "beta1": beta1, "beta2": beta2, "eps": eps, **decay_hyper(weight_decay),
                "warmup_steps": warmup_steps, "r": r, "weight_lr_power": weight_lr_power}

    def init(params: Any) -> ScheduleFreeState:
        leaves, spec = flatten_params(params)
        count = init_count(leaves)
        scalar = lambda v: torch.tensor(v, dtype=torch.float64, device=count.device)  # noqa: E731
        return ScheduleFreeState(count=count, z=optree.tree_unflatten(spec, [p.clone() for p in leaves]),
                                 exp_avg_sq=optree.tree_unflatten(spec, [torch.zeros_like(p) for p in leaves]),
                                 weight_sum=scalar(0.0), lr_max=scalar(-1.0), hyper=make_hyper(defaults, count.device))

    def update(grads: Any, state: ScheduleFreeState, params: Any) -> tuple[Any, ScheduleFreeState]:
        count = state.count
        unflatten, y, g, (z, v) = flatten_update(grads, params, state.z, state.exp_avg_sq, flatten=flatten)
        h = hyper_values(state.hyper, defaults)  # eagerly on the CPU: Python numbers, the package's arithmetic
        beta1, beta2, eps, weight_decay = h["beta1"], h["beta2"], h["eps"], h.get("weight_decay", 0.0)
        lr_t, bias_correction2, ckp1, weight_sum, lr_max = _scalars(
            host_number(count), host_number(lr_value(lr, count, h)), host_number(state.weight_sum),
            host_number(state.lr_max), beta2, h["warmup_steps"], h["r"], h["weight_lr_power"])
        as_state = lambda x: torch.as_tensor(x, dtype=torch.float64, device=count.device)  # noqa: E731
        new_scalars = dict(count=count + 1, weight_sum=as_state(weight_sum), lr_max=as_state(lr_max))
        if not y:
            return params, state._replace(**new_scalars)
        v = torch._foreach_mul(v, beta2)
        scaled_sq_into(v, g, 1 - beta2)
        denom = torch._foreach_div(v, bias_correction2)
        torch._foreach_sqrt_(denom)
        add_scalar_(denom, eps)
        gn = torch._foreach_div(g, denom)
        if isinstance(weight_decay, torch.Tensor):  # the state's value: always added (exact for 0)
            gn = add_scaled(gn, y, weight_decay)
        elif weight_decay != 0:
            torch._foreach_add_(gn, y, alpha=weight_decay)
        # a tensor weight (traced) goes as one per leaf: the number overload would read it on the host
        new_y = lerp(y, z, ckp1)
        new_y = sub_scaled(new_y, gn, -(lr_t * (beta1 * (1 - ckp1) - 1)))  # the package's add_(g', alpha=...)
        new_z = sub_scaled(z, gn, lr_t)
        new_state = ScheduleFreeState(z=unflatten(new_z), exp_avg_sq=unflatten(v), **new_scalars, hyper=state.hyper)
        return unflatten(new_y), new_state

    def eval_params(params: Any, state: ScheduleFreeState) -> Any:
        """``x``: the params moved towards ``z`` as the package's ``eval()`` moves them."""
        unflatten, y, _, (z,) = flatten_update(params, params, state.z)
        beta1 = hyper_values(state.hyper, defaults)["beta1"]
        return unflatten(lerp(y, z, lerp_weight(1 - 1 / beta1, y))) if y else params

    return Optimizer(init=init, update=update, learning_rate=make_learning_rate(lr, defaults), schedule=lr,
                     eval_params=eval_params, hyper=defaults)
