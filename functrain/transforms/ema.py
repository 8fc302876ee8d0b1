"""Exponential moving average of the parameters (stage ``after``)."""
from __future__ import annotations

from typing import Any, NamedTuple

import torch

from ..core import tree as T
from ..core.validate import check_int, check_real
from ..core.eager import TreespecCache, as_tensor, host_number, select
from ..core.transform import StepContext, Transform
from ..core.registry import register_checkpoint_type

__all__ = ["ema", "EmaState"]


@register_checkpoint_type("functrain.EmaState")
class EmaState(NamedTuple):
    """The ``"ema"`` slot: the averaged ``params`` and ``count``, the updates applied so far."""

    params: Any
    count: torch.Tensor


class EMA(Transform):
    """Keep ``ema = decay * ema + (1 - decay) * params`` after the optimizer update.

    Law: counting applied updates ``k = 1, 2, ...``: while ``k <= start_step`` the
    EMA copies the params; after that it blends on every ``k`` that is a
    multiple of ``every``. For constant params ``p`` and ``m`` blends,
    ``ema = decay**m * ema0 + (1 - decay**m) * p``. A skipped update (non-finite
    fp16 step, a non-final streaming micro-batch) does not count and does not
    touch the EMA. The choice is a select on the device.
    """

    name = "ema"
    order = 0
    accessors = {"ema": lambda slot: slot.params}  # state.ema: the averaged params (None without ft.ema)
    params_fields = ("params",)  # shaped like the params: a sharded step holds 1/N of it per rank

    def __init__(self, decay: float, every: int = 1, start_step: int = 0):
        self.decay = check_real("ema: decay", decay, lo=0, hi=1, lo_open=True, hi_open=True)
        self.every = check_int("ema: every", every, minimum=1)
        self.start_step = check_int("ema: start_step", start_step, minimum=0)
        self._flatten = TreespecCache()

    def init(self, params, buffers) -> EmaState:
        leaves = T.tree_leaves(params)
        return EmaState(T.tree_map(lambda p: p.detach().clone(), params),
                        torch.zeros((), dtype=torch.int64, device=leaves[0].device))

    def after(self, ctx: StepContext) -> None:
        old: EmaState = ctx.slot(self)
        ema, spec = self._flatten(old.params)
        params = spec.flatten_up_to(ctx.params)
        applied = True if ctx.apply is None else ctx.apply  # skipped updates do not count
        count = host_number(old.count) + applied  # eagerly, every update applied: a host int, decided on the host
        copy = applied & (count <= self.start_step)
        blend = applied & (count > self.start_step) & (count % self.every == 0)
        new = select(blend, lambda: torch._foreach_lerp(ema, params, 1.0 - self.decay),
                     lambda: select(copy, params, ema))
        ctx.set_slot(self, EmaState(T.tree_unflatten(spec, new), as_tensor(count, like=old.count)))

    def __repr__(self) -> str:
        return f"ema({self.decay}, every={self.every}, start_step={self.start_step})"


def ema(decay: float, every: int = 1, start_step: int = 0) -> EMA:
    """An EMA of the params in the state, read as ``state.ema``.

    Example::

        >>> import torch, functrain as ft
        >>> step = ft.ema(0.9)(ft.train_step(lambda p, b, x: (p["w"] * x).sum(), ft.optim.sgd(1.0)))
        >>> state, _ = step(step.init({"w": torch.zeros(1)}), torch.ones(1))
        >>> state.params["w"], state.ema["w"]
        (tensor([-1.]), tensor([-0.1000]))
    """
    return EMA(decay, every, start_step)
