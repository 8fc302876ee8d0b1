"""The functional optimizer interface and the helpers the optimizers share.

An optimizer is a pure ``(init, update)`` pair over pytrees. ``update`` returns
the *new params* (not Optax-style updates) so that its arithmetic can follow
``torch.optim`` operation for operation, and it never writes into its inputs,
so a whole training step can be traced by ``torch.compile(fullgraph=True)``.
"""
from __future__ import annotations

from functools import partial
from typing import Any, Callable, NamedTuple

import optree
import torch

from ..core import validate as _validate
# describe / is_real / leaf_path are re-exported for the optimizers (one copy, in _validate).
from ..core.validate import describe, is_real  # noqa: F401
from ..core.validate import path_str as leaf_path  # noqa: F401
# the one-path interface the optimizers' updates are written against (eager shortcuts inside)
from ..core.eager import (TreespecCache, double, host_number, per_step, select, sub_scaled,  # noqa: F401
                          sub_scaled_ratio)

__all__ = ["Optimizer"]


class Optimizer(NamedTuple):
    """A functional optimizer: three pure functions over pytrees, and two declared fields.

    Build one with :func:`~functrain.optim.sgd`, :func:`~functrain.optim.adamw`, ... or
    :func:`~functrain.optim.from_optax_style`; the constructor takes the fields below.

    Attributes:
        init: ``init(params) -> opt_state``: a pytree (a ``NamedTuple`` of tensors and trees
            of tensors) whose ``count`` field is an int64 scalar tensor on the params' device
            holding the number of updates already taken (0 at first).
        update: ``update(grads, opt_state, params) -> (new_params, new_opt_state)``: one step;
            ``grads`` has the structure of ``params``. Inputs are never modified.
        learning_rate: ``learning_rate(opt_state)``: the learning rate the *next* update will use
            (a float for a constant lr, a float64 scalar tensor for a schedule).
        per_param: (default ``False``) whether ``update`` treats parameters by name
            (``weight_decay_mask`` / ``lr_multipliers`` groups). A sharded data-parallel step
            updates flat per-dtype shards, which have no names, and refuses such an optimizer.
        schedule: (default ``None``) the lr it was built with, a float or a schedule
            ``callable(count) -> lr``, so that :func:`functrain.optim.schedules.check_covers` can
            refuse a schedule that ends before the run does (``None``: unknown, nothing is checked).
        eval_params: (default ``None``) ``eval_params(params, opt_state) -> params`` for an optimizer
            whose evaluation weights are not the trained ones (schedule-free AdamW's ``x``);
            :func:`functrain.optim.eval_params` reads it (``None``: the params themselves).

    Example::

        >>> import torch
        >>> from functrain.optim import sgd
        >>> opt = sgd(lr=0.1)
        >>> params = {"w": torch.ones(2)}
        >>> state = opt.init(params)
        >>> params, state = opt.update({"w": torch.ones(2)}, state, params)
        >>> params["w"], int(state.count), opt.learning_rate(state)
        (tensor([0.9000, 0.9000]), 1, 0.1)
    """

    init: Callable[[Any], Any]
    update: Callable[[Any, Any, Any], tuple]
    learning_rate: Callable[[Any], Any]
    per_param: bool = False
    schedule: Any = None
    eval_params: Callable[[Any, Any], Any] | None = None


# ----------------------------------------------------------------- validation
# The generic checks live in functrain/core/validate.py (they raise BadValue, both a
# TypeError and a ValueError); these wrappers keep the optimizers' wording.


def check_real(
    name: str,
    value: Any,
    *,
    lo: float | None = None,
    hi: float | None = None,
    hi_open: bool = False,
    what: str | None = None,
) -> float:
    """Return ``float(value)`` or raise :class:`~functrain.core.validate.BadValue` (a TypeError
    and a ValueError) naming ``name``, what is allowed and the value given.

    ``what`` describes the allowed values (defaults to a description of the range).

    Example::

        >>> from functrain.optim.base import check_real
        >>> check_real("eps", 1e-8, lo=0.0)
        1e-08
    """
    if what is None:
        if lo is not None and hi is not None:
            what = f"a float in [{lo:g}, {hi:g}{')' if hi_open else ']'}"
        elif lo is not None:
            what = f"a float >= {lo:g}"
        else:
            what = "a finite float"
    return _validate.check_real(name, value, lo=lo, hi=hi, hi_open=hi_open, what=what)


def check_steps(name: str, value: Any, *, minimum: int = 0) -> int:
    """Return ``int(value)`` for an integer (not a bool) >= ``minimum``, else BadValue.

    Example::

        >>> from functrain.optim.base import check_steps
        >>> check_steps("warmup_steps", 10)
        10
    """
    return _validate.check_int(name, value, minimum=minimum)


def check_lr(lr: Any) -> float | Callable[[Any], Any]:
    """A learning rate is a finite float >= 0 or a schedule ``callable(count) -> lr``."""
    what = "a float >= 0 or a schedule callable(count) -> lr"
    if callable(lr) and not isinstance(lr, torch.Tensor):
        return lr
    return check_real("lr", lr, lo=0.0, what=what)


def check_betas(betas: Any) -> tuple[float, float]:
    """Two floats, each in [0, 1)."""
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise TypeError(f"betas must be a pair (beta1, beta2) of floats in [0, 1); got {describe(betas)}")
    return tuple(check_real(f"betas[{i}]", b, lo=0.0, hi=1.0, hi_open=True) for i, b in enumerate(betas))


# ----------------------------------------------------------------- pytrees


def flatten_params(params: Any) -> tuple[list[torch.Tensor], Any]:
    """Flatten ``params`` at ``init``, checking every leaf is a floating-point tensor."""
    paths, leaves, spec = optree.tree_flatten_with_path(params)
    for path, leaf in zip(paths, leaves):
        if not isinstance(leaf, torch.Tensor):
            raise TypeError(
                f"params leaf {leaf_path(path)!r} must be a floating-point torch.Tensor; got {type(leaf).__name__}"
            )
        if not leaf.is_floating_point():
            raise TypeError(
                f"params leaf {leaf_path(path)!r} has dtype {leaf.dtype}; optimizers need floating-point "
                "params (keep integer buffers out of the params tree)"
            )
    return leaves, spec


def init_count(leaves: list[torch.Tensor]) -> torch.Tensor:
    """The int64 step counter (0), on the device of the first param."""
    device = leaves[0].device if leaves else None
    return torch.zeros((), dtype=torch.int64, device=device)


def flatten_update(grads: Any, params: Any, *trees: Any,
                   flatten: Callable = optree.tree_flatten) -> tuple[Callable, list, list, list[list]]:
    """Flatten ``params`` (with ``flatten``: an optimizer passes its :class:`functrain.core.eager.TreespecCache`)
    and bring ``grads`` and the state ``trees`` to its leaf order.

    0-dim leaves are viewed as shape ``(1,)``: a float64 0-dim scalar tensor would
    otherwise promote a 0-dim float32 leaf to float64 in ``_foreach_*(leaves, scalar)``
    (dimensioned leaves keep their dtype). Returns ``unflatten(leaves) -> tree`` that
    undoes both the flattening and those views.
    """
    p, spec = flatten(params)
    is_0d = [x.dim() == 0 for x in p]
    if not any(is_0d):
        return partial(optree.tree_unflatten, spec), p, spec.flatten_up_to(grads), [spec.flatten_up_to(t) for t in trees]

    def lift(leaves: list) -> list:
        return [x.reshape(1) if s else x for x, s in zip(leaves, is_0d)]

    def unflatten(leaves: list) -> Any:
        return optree.tree_unflatten(spec, [x.reshape(()) if s else x for x, s in zip(leaves, is_0d)])

    return unflatten, lift(p), lift(spec.flatten_up_to(grads)), [lift(spec.flatten_up_to(t)) for t in trees]


# ----------------------------------------------------------------- scalars


def lr_value(lr: float | Callable[[Any], Any], count: torch.Tensor) -> float | torch.Tensor:
    """The lr for the update taken at ``count``: the float, or ``schedule(count)`` as float64."""
    if not callable(lr):
        return lr
    value = lr(count)
    if isinstance(value, torch.Tensor):
        return per_step(value.to(dtype=torch.float64, device=count.device))[0]  # a cosine once, not per vector
    return torch.tensor(value, dtype=torch.float64, device=count.device)


def make_learning_rate(lr: float | Callable[[Any], Any]) -> Callable[[Any], Any]:
    """``learning_rate(opt_state)`` for an optimizer built with ``lr`` (give ``lr`` to the
    :class:`Optimizer` as its ``schedule`` too)."""

    def learning_rate(opt_state: Any) -> float | torch.Tensor:
        return lr_value(lr, opt_state.count)

    return learning_rate


# -- the paragraphs every optimizer's docstring shares, written once -------------------------------------------
_SHARED_DOCS = {
    "{LR}": """        lr: the learning rate: a finite float >= 0, or a schedule ``callable(count) -> lr``
            (:mod:`functrain.optim.schedules`) of the number of updates already taken.
""",
    "{GROUPS}": """        weight_decay_mask: which leaves get weight decay: ``None`` (default: every leaf), a
            pytree of bools shaped like the params, or a predicate ``callable(name, param) -> bool``
            such as :func:`functrain.optim.masks.no_decay_bias_and_norm` (:mod:`functrain.optim.groups`).
            With ``weight_decay=0`` it has no effect, and a ``UserWarning`` says so.
        lr_multipliers: a factor on the lr per leaf: ``None`` (default: 1.0 everywhere), a pytree
            of floats >= 0 shaped like the params, or ``callable(name, param) -> float``; a leaf's
            lr is ``lr * multiplier``.
""",
    "{RAISES}": """        BadValue: (a ``TypeError`` and a ``ValueError``, from :mod:`functrain.core.validate`) for an
            argument out of range or of the wrong type, naming it and what is allowed; a bad mask or
            multiplier leaf is reported by ``init``, which sees the params.
""",
}


def shared_docs(fn: Callable) -> Callable:
    """``fn`` with the paragraphs every optimizer's docstring shares filled in: a line ``{LR}``, ``{GROUPS}`` or
    ``{RAISES}`` (indented as an argument) stands for the text in ``_SHARED_DOCS``, written once here."""
    doc = fn.__doc__ or ""
    for key, text in _SHARED_DOCS.items():
        doc = doc.replace("        " + key + "\n", text)
    fn.__doc__ = doc
    return fn
