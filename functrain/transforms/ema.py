"""Exponential moving average of the parameters (stage ``after``), with ema-pytorch's warm-up by default."""
from __future__ import annotations

from typing import Any, NamedTuple

import torch

from ..core import tree as T
from ..core.validate import BadValue, check_int, check_real
from ..core.eager import TreespecCache, as_tensor, host_number, lerp, select
from ..core.hyper import make as make_hyper, values as hyper_values
from ..core.transform import StepContext, Transform
from ..core.registry import register_checkpoint_type

__all__ = ["ema", "EmaState", "WARMUP_START_STEP", "WARMUP_POWER"]

# ema-pytorch's defaults (EMA(update_after_step=100, power=2/3)), as denoising-diffusion-pytorch's Trainer uses them:
# ft.ema's and TrainConfig's, so the same numbers mean the same EMA through either
WARMUP_START_STEP = 100
WARMUP_POWER = 2 / 3
_UNSET: Any = object()


@register_checkpoint_type("functrain.EmaState")
class EmaState(NamedTuple):
    """The ``"ema"`` slot of :func:`ema` (``state.slots["ema"]``; ``state.ema`` is its ``params``).

    Attributes:
        params: the averaged params, a tree shaped like the params.
        count: the updates applied so far, an int64 scalar tensor.
        hyper: the EMA's constants as data (``"decay"``, ``"every"``, ``"start_step"``, and with a warm-up
            ``"power"``, ``"inv_gamma"``, ``"min_decay"``), 0-dim float64 tensors filled by ``init``
            (:func:`functrain.set_hyper`: ``ft.set_hyper(state, ema={"decay": 0.999})``); ``None``: the
            constructor's. Whether there is a warm-up is the step's structure.

    Example::

        >>> import torch, functrain as ft
        >>> step = ft.ema(0.9)(ft.train_step(lambda p, b, x: (p["w"] * x).sum(), ft.optim.sgd(1.0)))
        >>> slot = step.init({"w": torch.zeros(1)}).slots["ema"]
        >>> slot.params["w"], int(slot.count)
        (tensor([0.]), 0)
    """

    params: Any
    count: torch.Tensor
    hyper: Any = None


class EMA(Transform):
    """Keep ``ema = d * ema + (1 - d) * params`` after the optimizer update.

    Law: counting applied updates ``k = 1, 2, ...`` (a skipped update -- a non-finite
    fp16 step, a non-final streaming micro-batch -- does not count and does not touch
    the EMA; ``every`` counts updates, not calls): while ``k <= start_step`` the EMA
    copies the params; after that it blends on every ``k`` that is a multiple of
    ``every``, with ``d = decay``, or with a warm-up (``power`` given)
    ``d_k = clamp(1 - (1 + (k - start_step) / inv_gamma) ** -power, min_decay, decay)``.
    For constant params ``p`` and ``m`` blends of constant ``d``,
    ``ema = d**m * ema0 + (1 - d**m) * p``; with ``power = inv_gamma = 1``,
    ``every = 1``, ``start_step = 0`` (and ``decay`` not reached) the EMA after ``k``
    updates is the plain mean of the initial params and the ``k`` updated ones.
    Every choice is a select on the device, and the warm-up's ``d_k`` a tensor.
    """

    name = "ema"
    order = 0
    accessors = {"ema": lambda slot: slot.params}  # state.ema: the averaged params (None without ft.ema)
    params_fields = ("params",)  # shaped like the params: a sharded step holds 1/N of it per rank
    needs = "elementwise"  # a blend per element (the count and the decisions are scalars)

    def __init__(self, decay: float, every: int = 1, start_step: int = 0, *, power: float | None = None,
                 inv_gamma: float = 1.0, min_decay: float = 0.0):
        self.decay = check_real("ema: decay", decay, lo=0, hi=1, lo_open=True, hi_open=True)
        self.every = check_int("ema: every", every, minimum=1)
        self.start_step = check_int("ema: start_step", start_step, minimum=0)
        self.power = None if power is None else check_real("ema: power", power, lo=0, lo_open=True,
                                                              what="a number > 0 (finite), or None: no warm-up")
        self.inv_gamma = check_real("ema: inv_gamma", inv_gamma, lo=0, lo_open=True)
        self.min_decay = check_real("ema: min_decay", min_decay, lo=0, hi=self.decay,
                                    what=f"a number in [0, decay={self.decay:g}]")
        if self.power is None and (self.inv_gamma != 1.0 or self.min_decay != 0.0):
            raise BadValue(f"ema: inv_gamma and min_decay shape the warm-up, which power= turns on; with "
                           f"power=None they would be unused; got inv_gamma={inv_gamma!r}, min_decay={min_decay!r}")
        self._flatten = TreespecCache()
        # the values a user changes between runs: data in the slot (EmaState.hyper), not constants of the graph
        self.hyper = {"decay": self.decay, "every": self.every, "start_step": self.start_step}
        if self.power is not None:
            self.hyper.update(power=self.power, inv_gamma=self.inv_gamma, min_decay=self.min_decay)

    def decay_at(self, k: Any, hyper: dict | None = None) -> Any:
        """The decay of a blend at applied update ``k`` (an int, or an int64 tensor: then a float64 tensor), with
        the constants ``hyper`` (a slot's, read by :func:`functrain.core.hyper.values`; default: the constructor's).

        Example::

            >>> from functrain.transforms.ema import EMA
            >>> round(EMA(0.995, start_step=100, power=2 / 3).decay_at(110), 4)   # ema-pytorch's ramp
            0.7978
        """
        h = self.hyper if hyper is None else hyper
        decay = h["decay"]
        if self.power is None:
            return decay
        start, inv_gamma, power, min_decay = h["start_step"], h["inv_gamma"], h["power"], h["min_decay"]
        if isinstance(k, torch.Tensor) or isinstance(decay, torch.Tensor):
            epoch = torch.as_tensor(k - start).to(torch.float64)
            value = 1.0 - (1.0 + epoch / inv_gamma) ** -power
            if isinstance(decay, torch.Tensor):  # the state's bounds: clamp takes tensors for both
                return torch.maximum(torch.minimum(value, decay), min_decay)
            return value.clamp(min_decay, decay)
        value = 1.0 - (1.0 + (k - start) / inv_gamma) ** -power
        return min(decay, max(min_decay, value))

    def init(self, params, buffers) -> EmaState:
        leaves = T.tree_leaves(params)
        device = leaves[0].device
        return EmaState(T.tree_map(lambda p: p.detach().clone(), params),
                        torch.zeros((), dtype=torch.int64, device=device), make_hyper(self.hyper, device))

    def after(self, ctx: StepContext) -> None:
        old: EmaState = ctx.slot(self)
        ema, spec = self._flatten(old.params)
        params = spec.flatten_up_to(ctx.params)
        h = hyper_values(old.hyper, self.hyper)  # eagerly, CPU: Python numbers, the decisions made on the host
        applied = True if ctx.apply is None else ctx.apply  # skipped updates do not count
        count = host_number(old.count) + applied  # eagerly, every update applied: a host int, decided on the host
        copy = applied & (count <= h["start_step"])
        blend = applied & (count > h["start_step"]) & (count % h["every"] == 0)
        new = select(blend, lambda: self._blend(ema, params, count, h), lambda: select(copy, params, ema))
        ctx.set_slot(self, EmaState(T.tree_unflatten(spec, new), as_tensor(count, like=old.count), old.hyper))

    def _blend(self, ema: list, params: list, count: Any, h: dict) -> list:
        weight = 1.0 - self.decay_at(count, h)  # a Python float, or (count or the constants tensors) a float64 tensor
        if isinstance(weight, torch.Tensor):
            # one weight per leaf, in float32 (float64 leaves: float64), the precision lerp computes in for a
            # Python-float weight; a float of the count would be a host read
            weight = [weight.to(torch.promote_types(e.dtype, torch.float32)) for e in ema]
        return lerp(ema, params, weight)

    def __repr__(self) -> str:
        warmup = "" if self.power is None else \
            f", power={self.power:g}, inv_gamma={self.inv_gamma:g}, min_decay={self.min_decay:g}"
        return f"ema({self.decay}, every={self.every}, start_step={self.start_step}{warmup})"


def ema(decay: float, every: int = 1, start_step: int = _UNSET, *, warmup: bool = True, power: float | None = _UNSET,
        inv_gamma: float = 1.0, min_decay: float = 0.0) -> EMA:
    """An EMA of the params in the state, read as ``state.ema``: by default ema-pytorch's, warm-up included.

    ``ft.ema(0.995, every=10)`` is the EMA denoising-diffusion-pytorch's Trainer keeps with ``ema_decay=0.995,
    ema_update_every=10`` (ema-pytorch's ``update_after_step=100``, ``power=2/3``), and what ``ft.TrainConfig`` with
    the same numbers gives. ``warmup=False`` is the plain EMA: ``d = decay`` from the first update.

    ema-pytorch decides on the count before the update (its ``step``) and functrain on the count
    including it: ``ema(b, every, start_step=N, power=p)`` after update ``k >= N`` (``N`` a multiple
    of ``every``) equals ema-pytorch's ``EMA(beta=b, update_every=every, update_after_step=N,
    power=p)`` one update later, fed the same params.

    Args:
        decay: the decay of a blend, in (0, 1); with a warm-up, its cap.
        every: blend on every ``every``-th applied update, an int >= 1 (default 1; updates, not calls:
            a skipped update does not count).
        start_step: copy the params for the first ``start_step`` applied updates, an int >= 0 (default 100,
            ema-pytorch's ``update_after_step``; 0 with ``warmup=False``).
        warmup: ``True`` (default): ema-pytorch's warm-up, ``power`` defaulting to 2/3; ``False``: the plain EMA
            (``power`` and ``start_step`` default to ``None`` and 0; a ``power`` then is refused).
        power: a number > 0: the warm-up
            ``d_k = clamp(1 - (1 + (k - start_step) / inv_gamma) ** -power, min_decay, decay)`` at
            applied update ``k``, ema-pytorch's inverse-gamma ramp (default 2/3, its default, as
            denoising-diffusion-pytorch's Trainer uses it, with ``inv_gamma=1``, ``min_decay=0``); ``None``:
            a constant ``decay`` after ``start_step``.
        inv_gamma: the ramp's scale, a number > 0 (default 1.0; only with ``power``).
        min_decay: the ramp's floor, in [0, decay] (default 0.0; only with ``power``).

    Returns:
        The :class:`EMA` transform (stage ``after``, slot ``"ema"`` holding an :class:`EmaState`).

    Raises:
        BadValue: an argument out of its range, ``inv_gamma`` / ``min_decay`` changed without ``power``, or a
            ``power`` with ``warmup=False``.

    Example::

        >>> import torch, functrain as ft
        >>> ft.ema(0.995, every=10)
        ema(0.995, every=10, start_step=100, power=0.666667, inv_gamma=1, min_decay=0)
        >>> step = ft.ema(0.9, warmup=False)(ft.train_step(lambda p, b, x: (p["w"] * x).sum(), ft.optim.sgd(1.0)))
        >>> state, _ = step(step.init({"w": torch.zeros(1)}), torch.ones(1))
        >>> state.params["w"], state.ema["w"]
        (tensor([-1.]), tensor([-0.1000]))
        >>> warm = ft.ema(0.999, start_step=0, power=1.0)(ft.train_step(lambda p, b, x: (p["w"] * x).sum(),
        ...                                                             ft.optim.sgd(1.0)))
        >>> state, _ = warm(warm.init({"w": torch.zeros(1)}), torch.ones(1))
        >>> state.ema["w"]   # d_1 = 1 - 2**-1: the mean of the initial and the updated params
        tensor([-0.5000])
    """
    if not isinstance(warmup, bool):
        raise BadValue(f"ema: warmup must be True (ema-pytorch's warm-up) or False (the plain EMA); got {warmup!r}")
    if not warmup and power is not _UNSET and power is not None:
        raise BadValue(f"ema: power={power!r} shapes the warm-up, which warmup=False turns off; drop one of them")
    if start_step is _UNSET:
        start_step = WARMUP_START_STEP if warmup else 0
    if power is _UNSET:
        power = WARMUP_POWER if warmup else None
    return EMA(decay, every, start_step, power=power, inv_gamma=inv_gamma, min_decay=min_decay)
