"""Gradient clipping: by global L2 norm and by value (stage ``transform``)."""
from __future__ import annotations

import torch

from ..core import tree as T
from ..core.validate import BadValue, describe, is_real
from ..core.transform import StepContext, Transform

__all__ = ["clip", "clip_value"]


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

    def __init__(self, max_norm: float):
        self.max_norm = _positive("clip: max_norm", max_norm)

    def transform(self, ctx: StepContext) -> None:
        norm = T.global_norm(ctx.grads)
        if ctx.shard_group is not None:  # ctx.grads is this rank's shard: the norm is over every rank's shard
            norm = ctx.global_sum(norm.square()).sqrt()  # (the shards' zero padding adds nothing)
        ctx.metrics["grad_norm"] = norm
        coef = torch.clamp(self.max_norm / (norm + 1e-6), max=1.0)
        ctx.grads = T.tree_scale(ctx.grads, coef)

    def __repr__(self) -> str:
        return f"clip({self.max_norm})"


class ClipValue(Transform):
    """Clamp every gradient element to ``[-value, value]`` (after ``clip`` when both are used)."""

    name = "clip_value"
    order = 20
    needs = "elementwise"

    def __init__(self, value: float):
        self.value = _positive("clip_value: value", value)

    def transform(self, ctx: StepContext) -> None:
        v = self.value
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
        The :class:`Clip` transform (stage ``transform``, no slot).

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
        The :class:`ClipValue` transform (stage ``transform``, no slot).

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
