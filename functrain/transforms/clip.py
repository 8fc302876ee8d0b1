"""Gradient clipping: by global L2 norm and by value (stage ``transform``)."""
from __future__ import annotations

from typing import Any, NamedTuple

import torch

from ..core import tree as T
from ..core.hyper import make as make_hyper, values as hyper_values
from ..core.registry import register_checkpoint_type
from ..core.validate import BadValue, describe, is_real
from ..core.transform import StepContext, Transform

__all__ = ["clip", "clip_value", "ClipState"]


@register_checkpoint_type("functrain.ClipState")
class ClipState(NamedTuple):
    """The slot of :func:`clip` and :func:`clip_value`: their bound as data (``{"max_norm": tensor}`` or
    ``{"value": tensor}``, a 0-dim float64 tensor), so a compiled step serves every bound
    (:func:`functrain.set_hyper`, e.g. ``ft.set_hyper(state, clip={"max_norm": 0.5})``). ``None`` (a state
    saved before it was data): the constructor's.

    Example::

        >>> import torch, functrain as ft
        >>> step = ft.clip(1.0)(ft.train_step(lambda p, b, x: (p["w"] * x).sum(), ft.optim.sgd(0.1)))
        >>> float(ft.get_hyper(step.init({"w": torch.zeros(1)}))["clip"]["max_norm"])
        1.0
    """

    hyper: Any = None


def _slot(params: Any, defaults: dict) -> ClipState:
    leaves = T.tree_leaves(params)
    return ClipState(make_hyper(defaults, leaves[0].device if leaves else None))


def _positive(name: str, value: float) -> float:
    # > 0 and not NaN; inf is allowed (no clipping), so not check_real, which wants a finite number
    if not (is_real(value) and value > 0):
        raise BadValue(f"{name} must be a positive number; got {describe(value)}")
    return float(value)


class Clip(Transform):
    """Scale the whole gradient pytree so that its global L2 norm is at most ``max_norm``.

    Law: the clipped gradient is ``g * min(1, max_norm / (|g| + 1e-6))`` (as
    ``torch.nn.utils.clip_grad_norm_``), so its norm is ``min(|g|, max_norm)`` up
    to that epsilon and its direction is unchanged. It acts on the normalised,
    unscaled, process-reduced gradient whatever the wrapping order; with a
    sharded gradient (``data_parallel(shard=...)``) the norm is summed over the
    shards (:meth:`~functrain.StepContext.global_sum`), so every rank scales by
    the same global factor. ``metrics["grad_norm"]`` is the norm before clipping.
    """

    name = "clip"
    order = 10
    needs = "global"  # the norm: sqrt(ctx.global_sum(|shard|^2)) when the gradient is a shard
    GRAPH_DATA = ("max_norm",)  # data in the slot, not structure (functrain.compiler.prekey)

    def __init__(self, max_norm: float):
        self.max_norm = _positive("clip: max_norm", max_norm)

    def init(self, params: Any, buffers: Any) -> ClipState:
        return _slot(params, {"max_norm": self.max_norm})

    def transform(self, ctx: StepContext) -> None:
        norm = T.global_norm(ctx.grads)
        if ctx.shard_group is not None:  # ctx.grads is this rank's shard: the norm is over every rank's shard
            norm = ctx.global_sum(norm.square()).sqrt()  # (the shards' zero padding adds nothing)
        ctx.metrics["grad_norm"] = norm
        max_norm = hyper_values(ctx.slot(self).hyper, {"max_norm": self.max_norm})["max_norm"]
        if isinstance(max_norm, torch.Tensor):  # the state's value: in the norm's precision, as a number would be
            max_norm = max_norm.to(norm.dtype)
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        ctx.grads = T.tree_scale(ctx.grads, coef)

    def __repr__(self) -> str:
        return f"clip({self.max_norm})"


class ClipValue(Transform):
    """Clamp every gradient element to ``[-value, value]`` (after ``clip`` when both are used)."""

    name = "clip_value"
    order = 20
    needs = "elementwise"
    GRAPH_DATA = ("value",)  # data in the slot, not structure (functrain.compiler.prekey)

    def __init__(self, value: float):
        self.value = _positive("clip_value: value", value)

    def init(self, params: Any, buffers: Any) -> ClipState:
        return _slot(params, {"value": self.value})

    def transform(self, ctx: StepContext) -> None:
        v = hyper_values(ctx.slot(self).hyper, {"value": self.value})["value"]
        if isinstance(v, torch.Tensor):  # the state's value: clamp takes a tensor bound as min and max both
            ctx.grads = T.tree_map(lambda g: torch.clamp(g, -v.to(g.dtype), v.to(g.dtype)), ctx.grads)
        else:
            ctx.grads = T.tree_map(lambda g: torch.clamp(g, -v, v), ctx.grads)

    def __repr__(self) -> str:
        return f"clip_value({self.value})"


def clip(max_norm: float) -> Clip:
    """Clip gradients by their global L2 norm (as ``torch.nn.utils.clip_grad_norm_``).

    The gradient becomes ``g * min(1, max_norm / (|g| + 1e-6))``; ``metrics["grad_norm"]``
    is the norm before clipping. Under ``data_parallel(shard=...)`` the norm is over every
    rank's shard.

    Args:
        max_norm: the largest norm kept, a number > 0 (``float("inf")``: measure, never clip).

    Returns:
        The :class:`Clip` transform (stage ``transform``, slot ``"clip"``: its :class:`ClipState`, the bound as data).

    Raises:
        BadValue: ``max_norm`` is not a positive number.

    Example::

        >>> import torch, functrain as ft
        >>> step = ft.clip(1.0)(ft.train_step(lambda p, b, x: (p["w"] * x).sum(), ft.optim.sgd(0.1)))
        >>> _, metrics = step(step.init({"w": torch.zeros(4)}), torch.full((4,), 3.0))
        >>> float(metrics["grad_norm"])
        6.0
    """
    return Clip(max_norm)


def clip_value(value: float) -> ClipValue:
    """Clip every gradient element to ``[-value, value]`` (after :func:`clip` when both are used).

    Args:
        value: the bound, a number > 0.

    Returns:
        The :class:`ClipValue` transform (stage ``transform``, slot ``"clip_value"``: its :class:`ClipState`).

    Raises:
        BadValue: ``value`` is not a positive number.

    Example::

        >>> import torch, functrain as ft
        >>> step = ft.clip_value(0.5)(ft.train_step(lambda p, b, x: (p["w"] * x).sum(), ft.optim.sgd(1.0)))
        >>> state, _ = step(step.init({"w": torch.zeros(2)}), torch.tensor([3.0, -0.25]))
        >>> state.params["w"]
        tensor([-0.5000,  0.2500])
    """
    return ClipValue(value)
