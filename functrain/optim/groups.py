"""Parameter groups as pure data: which leaves get weight decay and which lr multiplier.

``torch.optim`` users split the params into param groups with their own
``weight_decay`` and ``lr``. Here the same is said per leaf, with
``weight_decay_mask=`` and ``lr_multipliers=``; the optimizers partition the
leaves into groups of equal ``(decay, lr_mult)`` and run each group with its
own scalars, exactly as ``torch.optim`` runs each param group, so the
arithmetic (and the bits, in eager fp32) is the same.

Both arguments accept either a pytree with the structure of the params (leaves
``bool`` / ``float``), or a function ``fn(name, param)`` of the leaf's name (its
pytree path joined by ``"/"``: ``"fc.weight"`` for the flat dict that
:func:`functrain.functionalize` returns, ``"block/w"`` for nested dicts) and
the leaf tensor. The functions run in Python while the step is traced, so they
must return plain Python ``bool`` / ``float`` values (shapes and names are
static; a tensor is refused).
"""
from __future__ import annotations

import math
import warnings
from typing import Any, Callable, NamedTuple, Sequence

import optree
import torch

from ..core.validate import BadValue, describe, is_real, path_str
from ..core.flat import FlatParams

__all__ = ["Group", "check_group_args", "decay_mask", "lr_multipliers", "make_groups", "run_groups", "group_lr"]


_TENSOR_HINT = "; the groups are decided in Python from names and shapes, so return a Python value"


class Group(NamedTuple):
    """Leaves that share a weight decay flag and an lr multiplier (one torch.optim param group).

    Attributes:
        index: the leaves' positions in the params' flatten order.
        decay: whether weight decay applies to them.
        lr_mult: the factor on the lr, a float >= 0.

    Example::

        >>> import torch
        >>> from functrain.optim.groups import make_groups
        >>> make_groups({"b": torch.ones(2), "w": torch.ones(2, 2)}, lambda n, p: p.ndim > 1, None)
        [Group(index=(0,), decay=False, lr_mult=1.0), Group(index=(1,), decay=True, lr_mult=1.0)]
    """

    index: tuple[int, ...]
    decay: bool
    lr_mult: float


def _check_arg(name: str, value: Any, allowed: str) -> Any:
    if value is None or callable(value) and not isinstance(value, torch.Tensor):
        return value
    if isinstance(value, (bool, float, int, str, torch.Tensor)):
        raise BadValue(f"{name} must be {allowed}; got {describe(value)}")
    return value  # a pytree: checked against the params at init


def check_group_args(owner: str, weight_decay: float, weight_decay_mask: Any, lr_multipliers: Any) -> None:
    """Check the group arguments of optimizer ``owner`` at construction (the params come later).

    Args:
        owner: the optimizer's name, for the messages (``"adamw"``).
        weight_decay: the optimizer's weight decay; a mask with ``weight_decay=0`` warns.
        weight_decay_mask: ``None``, a pytree of bools, or a predicate ``callable(name, param) -> bool``.
        lr_multipliers: ``None``, a pytree of floats, or ``callable(name, param) -> float``.

    Returns:
        ``None``.

    Raises:
        BadValue: either argument is a single bool, number, string or tensor (not a tree or callable).

    Example::

        >>> from functrain.optim.groups import check_group_args
        >>> check_group_args("sgd", 0.1, None, {"w": 2.0})
        >>> check_group_args("sgd", 0.1, True, None)
        Traceback (most recent call last):
        ...
        functrain.core.validate.BadValue: sgd: weight_decay_mask must be None, a pytree of bools shaped like the params, or a predicate callable(name, param) -> bool; got True (bool)
    """
    _check_arg(f"{owner}: weight_decay_mask", weight_decay_mask,
               "None, a pytree of bools shaped like the params, or a predicate callable(name, param) -> bool")
    _check_arg(f"{owner}: lr_multipliers", lr_multipliers,
               "None, a pytree of floats shaped like the params, or a function callable(name, param) -> float")
    if weight_decay_mask is not None and weight_decay == 0:
        warnings.warn(f"{owner}: weight_decay_mask has no effect with weight_decay=0", UserWarning, stacklevel=3)


def _per_leaf(arg: Any, params: Any, argname: str) -> tuple[list[str], list[Any], list[Any]]:
    """The names, leaves and per-leaf values of ``arg`` (a pytree or a function of ``(name, param)``)."""
    if isinstance(params, FlatParams):
        raise BadValue(f"{argname} is per parameter, but these params are flat (ft.flat / init(flat=True): one "
                       f"buffer per dtype); per-parameter groups need the plain params tree: drop flat=True")
    paths, leaves, spec = optree.tree_flatten_with_path(params)
    names = [path_str(p) for p in paths]
    if callable(arg):
        values = [arg(n, leaf) for n, leaf in zip(names, leaves)]
    else:
        try:
            values = spec.flatten_up_to(arg)
        except (ValueError, TypeError) as e:
            raise BadValue(
                f"{argname} must have the structure of the params ({len(leaves)} leaves: "
                f"{names[:6]}{'...' if len(names) > 6 else ''}); got {type(arg).__name__}: {e}"
            ) from None
    return names, leaves, values


def decay_mask(weight_decay_mask: Any, params: Any) -> list[bool]:
    """Per leaf (flatten order): ``True`` where weight decay applies.

    Args:
        weight_decay_mask: ``None`` (every leaf), a pytree of bools shaped like ``params``, or a
            predicate ``callable(name, param) -> bool`` (``name``: the leaf's path joined by ``"/"``).
        params: the params tree (not :class:`~functrain.FlatParams`: flat buffers have no names).

    Returns:
        A list of bools, one per leaf in flatten order.

    Raises:
        BadValue: the params are flat, the mask's structure differs from the params', or a value is not a bool.

    Example::

        >>> import torch
        >>> from functrain.optim.groups import decay_mask
        >>> decay_mask(lambda name, p: p.ndim > 1, {"w": torch.ones(2, 2), "b": torch.ones(2)})
        [False, True]
    """
    if weight_decay_mask is None:
        return [True] * len(optree.tree_leaves(params))
    names, _, values = _per_leaf(weight_decay_mask, params, "weight_decay_mask")
    out = []
    for name, v in zip(names, values):
        if not isinstance(v, bool):
            raise BadValue(f"weight_decay_mask for param {name!r} must be a bool (True = decay); got {describe(v)}"
                           + _TENSOR_HINT * isinstance(v, torch.Tensor))
        out.append(bool(v))
    return out


def lr_multipliers(multipliers: Any, params: Any) -> list[float]:
    """Per leaf (flatten order): the factor on the lr.

    Args:
        multipliers: ``None`` (1.0 everywhere), a pytree of floats shaped like ``params``, or
            ``callable(name, param) -> float``.
        params: the params tree (not :class:`~functrain.FlatParams`).

    Returns:
        A list of floats (finite, >= 0), one per leaf in flatten order.

    Raises:
        BadValue: the params are flat, the structure differs, or a value is not a finite float >= 0.

    Example::

        >>> import torch
        >>> from functrain.optim.groups import lr_multipliers
        >>> lr_multipliers({"head": 10.0, "body": 1.0}, {"head": torch.ones(2), "body": torch.ones(2)})
        [1.0, 10.0]
    """
    if multipliers is None:
        return [1.0] * len(optree.tree_leaves(params))
    names, _, values = _per_leaf(multipliers, params, "lr_multipliers")
    out = []
    for name, v in zip(names, values):
        if not is_real(v) or not math.isfinite(float(v)) or float(v) < 0:
            raise BadValue(f"lr_multipliers for param {name!r} must be a finite float >= 0; got {describe(v)}"
                           + _TENSOR_HINT * isinstance(v, torch.Tensor))
        out.append(float(v))
    return out


def make_groups(params: Any, weight_decay_mask: Any, multipliers: Any, n: int | None = None) -> list[Group]:
    """Partition the leaves by ``(decay, lr_mult)``, in order of first appearance.

    Args:
        params: the params tree.
        weight_decay_mask: as in :func:`decay_mask`.
        multipliers: as in :func:`lr_multipliers`.
        n: the number of leaves, when the caller has flattened ``params`` already (default
            ``None``: counted here); used only when both arguments are ``None``.

    Returns:
        A list of :class:`Group`; one group of every leaf when both arguments are ``None``.

    Example::

        >>> import torch
        >>> from functrain.optim.groups import make_groups
        >>> make_groups({"a": torch.ones(1), "b": torch.ones(1)}, None, {"a": 2.0, "b": 1.0})
        [Group(index=(0,), decay=True, lr_mult=2.0), Group(index=(1,), decay=True, lr_mult=1.0)]
    """
    if weight_decay_mask is None and multipliers is None:
        return [Group(tuple(range(len(optree.tree_leaves(params)) if n is None else n)), True, 1.0)]
    decay = decay_mask(weight_decay_mask, params)
    mult = lr_multipliers(multipliers, params)
    groups: dict[tuple[bool, float], list[int]] = {}
    for i, key in enumerate(zip(decay, mult)):
        groups.setdefault(key, []).append(i)
    return [Group(tuple(ix), d, m) for (d, m), ix in groups.items()]


def run_groups(groups: Sequence[Group], fn: Callable[..., tuple], *lists: list) -> tuple[list, ...]:
    """Call ``fn`` per group on the group's part of each list, and put the results back in leaf order.

    Args:
        groups: the :class:`Group` list of :func:`make_groups`.
        fn: ``fn(group, *sublists) -> tuple of sublists``, one output list per result.
        *lists: per-leaf lists (params, grads, buffers), all in flatten order.

    Returns:
        A tuple of per-leaf lists, in flatten order.

    Example::

        >>> from functrain.optim.groups import Group, run_groups
        >>> groups = [Group((0, 2), True, 1.0), Group((1,), True, 10.0)]
        >>> run_groups(groups, lambda g, xs: ([x * g.lr_mult for x in xs],), [1.0, 2.0, 3.0])
        ([1.0, 20.0, 3.0],)
    """
    if len(groups) == 1:
        return fn(groups[0], *lists)
    out: list[list] | None = None
    for group in groups:
        res = fn(group, *([xs[i] for i in group.index] for xs in lists))
        if out is None:
            out = [[None] * len(lists[0]) for _ in res]
        for dst, src in zip(out, res):
            for i, x in zip(group.index, src):
                dst[i] = x
    return tuple(out)


def group_lr(lr_t: float | torch.Tensor, group: Group) -> float | torch.Tensor:
    """The group's lr: ``lr_t * lr_mult`` (a torch param group with ``lr = base_lr * mult``).

    Args:
        lr_t: the base lr of this update, a float or a scalar tensor.
        group: the :class:`Group`.

    Returns:
        ``lr_t`` itself when the multiplier is 1.0, else ``lr_t * group.lr_mult``.

    Example::

        >>> from functrain.optim.groups import Group, group_lr
        >>> group_lr(0.5, Group((0,), True, 4.0))
        2.0
    """
    return lr_t if group.lr_mult == 1.0 else lr_t * group.lr_mult
