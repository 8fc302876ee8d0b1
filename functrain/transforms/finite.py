"""Skip updates whose loss or gradients are not finite (stage ``check``)."""
from __future__ import annotations

import torch

from ..core import tree as T
from ..core.transform import StepContext, Transform

__all__ = ["skip_nonfinite"]


class SkipNonfinite(Transform):
    """Drop the update of a step whose loss or gradient has an inf or NaN.

    Params, optimizer state and EMA stay bitwise unchanged on such a step (the
    choice is a select on the device, no host sync); ``metrics["skipped"]`` says
    whether it happened and the slot counts the skipped steps
    (``state.slots["skip_nonfinite"]["skipped"]``). For fp32 and bf16 runs;
    ``mixed_precision("fp16")`` does this itself as part of loss scaling.
    Under data parallelism the decision is the same on every rank: the
    gradient is reduced first, and a sharded gradient's finite check is summed
    over the shards (:meth:`~functrain.StepContext.skip_unless_finite`), so a
    non-finite value in one rank's shard skips the update everywhere.
    """

    name = "skip_nonfinite"
    order = 10
    needs = "global"  # ctx.skip_unless_finite sums every shard's "not finite" flag over the ranks

    def init(self, params, buffers):
        device = T.tree_leaves(params)[0].device
        return {"skipped": torch.zeros((), dtype=torch.int64, device=device)}

    def check(self, ctx: StepContext) -> None:
        finite = ctx.skip_unless_finite()
        dropped = ~finite if ctx.boundary is None else ~finite & ctx.boundary  # count updates, not micro-batches
        ctx.set_slot(self, {"skipped": ctx.slot(self)["skipped"] + dropped.to(torch.int64)})

    def __repr__(self) -> str:
        return "skip_nonfinite()"


def skip_nonfinite() -> SkipNonfinite:
    """Skip the update of any step whose loss or gradients are not finite.

    Params, optimizer state and EMA stay bitwise unchanged on such a step (a select on
    the device); ``metrics["skipped"]`` says whether it happened and
    ``state.slots["skip_nonfinite"]["skipped"]`` counts the skipped updates.

    Returns:
        The :class:`SkipNonfinite` transform (stage ``check``, slot ``"skip_nonfinite"``).

    Example::

        >>> import torch, functrain as ft
        >>> step = ft.skip_nonfinite()(ft.train_step(lambda p, b, x: (p["w"] * x).sum(), ft.optim.sgd(0.1)))
        >>> state = step.init({"w": torch.ones(2)})
        >>> new, metrics = step(state, torch.tensor([1.0, float("inf")]))
        >>> bool(metrics["skipped"]), bool(torch.equal(new.params["w"], state.params["w"]))
        (True, True)
    """
    return SkipNonfinite()
