"""Mixed precision (stages ``loss``, ``check`` and ``commit``): policies and dynamic loss scaling."""
from __future__ import annotations

from typing import Any, Callable, NamedTuple

import torch

from ..core import tree as T
from ..core.hyper import make as make_hyper, values as hyper_values
from ..core.validate import check_int, check_real
from ..core.transform import StepContext, Transform
from ..core.registry import register_checkpoint_type

__all__ = ["Policy", "LossScaleState", "mixed_precision"]

_NAMES = {"no": None, "fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


class Policy(NamedTuple):
    """Which dtype params are kept in, computed in, and the loss is returned in.

    Attributes:
        param_dtype: the master params' dtype (default ``torch.float32``); ``init`` refuses params of another.
        compute_dtype: the dtype the loss function runs in, under ``torch.autocast`` (default
            ``torch.float32``); ``torch.float16`` turns on dynamic loss scaling.
        output_dtype: the dtype of the differentiated loss (default ``torch.float32``).

    Example::

        >>> import torch, functrain as ft
        >>> policy = ft.Policy(torch.float32, torch.bfloat16, torch.float32)  # fp32 master, bf16 compute
        >>> ft.mixed_precision(policy)
        mixed_precision(Policy(param_dtype=torch.float32, compute_dtype=torch.bfloat16, output_dtype=torch.float32))
    """

    param_dtype: torch.dtype = torch.float32
    compute_dtype: torch.dtype = torch.float32
    output_dtype: torch.dtype = torch.float32


@register_checkpoint_type("functrain.LossScaleState")
class LossScaleState(NamedTuple):
    """The ``"mixed_precision"`` slot with a dynamic loss scale (``state.loss_scale``).

    Attributes:
        scale: the current loss scale, a float32 scalar tensor.
        good_steps: the finite updates since the scale last changed, an int64 scalar tensor.
        hyper: the scale's settings as data (``"growth_factor"``, ``"backoff_factor"``, ``"growth_interval"``),
            0-dim float64 tensors (:func:`functrain.set_hyper`: ``ft.set_hyper(state, mixed_precision=
            {"growth_interval": 500})``); ``None``: the constructor's. ``init_scale`` is the first ``scale``.

    Example::

        >>> import torch, functrain as ft
        >>> step = ft.mixed_precision("fp16")(ft.train_step(lambda p, b, x: (p["w"] * x).sum(), ft.optim.sgd(0.1)))
        >>> s = step.init({"w": torch.ones(2)}).loss_scale
        >>> float(s.scale), int(s.good_steps)
        (65536.0, 0)
    """

    scale: torch.Tensor
    good_steps: torch.Tensor
    hyper: Any = None


def _cast_floating(tree: Any, dtype: torch.dtype) -> Any:
    return T.tree_map(lambda x: x.to(dtype) if torch.is_tensor(x) and x.is_floating_point() else x, tree)


class MixedPrecision(Transform):
    """Compute the loss in a low-precision dtype from fp32 master params.

    The loss stage casts params, buffers and the batch's floating tensors to
    ``policy.compute_dtype`` and runs the loss function under ``torch.autocast``
    with that dtype (so the ops autocast keeps in fp32 — losses, softmax, norms,
    reductions — stay there: an fp16 loss would overflow its own gradient at a
    loss scale of 2**16), then casts the loss to ``policy.output_dtype``;
    gradients flow back through the casts to the master params in their own dtype. Buffers the forward pass changes
    (BatchNorm statistics) are cast back to their dtype.

    With fp16 a dynamic loss scale lives in the state: the loss is multiplied by
    it, the gradients are unscaled in the ``check`` stage (after the
    data-parallel reduction), a non-finite gradient drops the update (params,
    optimizer state, EMA unchanged; ``metrics["skipped"]``) and multiplies the
    scale by ``backoff_factor``, and ``growth_interval`` finite updates in a row
    multiply it by ``growth_factor``. All of it is selected on the device. The
    overflow check is :meth:`~functrain.StepContext.skip_unless_finite`: with a
    sharded gradient (``data_parallel(shard=...)``) it counts every rank's
    shard, so all ranks skip, and back off the scale, together.
    """

    name = "mixed_precision"
    order = 0
    needs = "global"  # casts and unscales per element; the overflow check sums over the ranks (skip_unless_finite)
    accessors = {"loss_scale": lambda slot: slot}  # state.loss_scale: the LossScaleState (None unless fp16)

    def __init__(self, policy: Any = "bf16", init_scale: float = 2.0 ** 16, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 2000, dynamic: bool | None = None):
        self.policy = _policy(policy)
        fp16 = self.policy.compute_dtype == torch.float16
        self.dynamic = fp16 if dynamic is None else bool(dynamic)
        self.init_scale = check_real("mixed_precision: init_scale", init_scale, lo=0, lo_open=True)
        self.growth_factor = check_real("mixed_precision: growth_factor", growth_factor, lo=1)
        self.backoff_factor = check_real("mixed_precision: backoff_factor", backoff_factor, lo=0, hi=1,
                                         lo_open=True, hi_open=True)
        self.growth_interval = check_int("mixed_precision: growth_interval", growth_interval, minimum=1)
        # the values a user changes between runs: data in the slot (LossScaleState.hyper), not graph constants
        self.hyper = {"growth_factor": self.growth_factor, "backoff_factor": self.backoff_factor,
                      "growth_interval": self.growth_interval}

    def init(self, params, buffers) -> LossScaleState | None:
        for leaf in T.tree_leaves(params):
            if leaf.dtype != self.policy.param_dtype:
                raise TypeError(f"mixed_precision: params must be {self.policy.param_dtype} (the policy's "
                                f"param_dtype); got a {leaf.dtype} leaf. Keep master params in fp32")
        if not self.dynamic:
            return None
        device = T.tree_leaves(params)[0].device
        return LossScaleState(torch.full((), self.init_scale, dtype=torch.float32, device=device),
                              torch.zeros((), dtype=torch.int64, device=device), make_hyper(self.hyper, device))

    @property
    def _casts(self) -> bool:
        return self.policy.compute_dtype != self.policy.param_dtype

    def wrap_loss(self, loss_fn: Callable, ctx: StepContext) -> Callable:
        policy, scale = self.policy, (ctx.slot(self).scale if self.dynamic else None)
        if not self._casts and scale is None:
            return loss_fn

        def cast_loss(params, buffers, batch):
            dtypes = T.tree_map(lambda b: b.dtype, buffers)
            if self._casts:
                params = _cast_floating(params, policy.compute_dtype)
                buffers = _cast_floating(buffers, policy.compute_dtype)
                batch = _cast_floating(batch, policy.compute_dtype)
            if self._casts:
                # autocast keeps the loss's own math (reductions, softmax, norms) in fp32 as its op
                # lists say, so the loss and its first gradients do not overflow fp16
                # (a per-block sharded step hands the blocks' parameters as meta placeholders)
                device_type = next((x.device.type for x in T.tree_leaves(params) if x.device.type != "meta"),
                                   T.tree_leaves(params)[0].device.type)
                with torch.autocast(device_type=device_type, dtype=policy.compute_dtype):
                    objective, out = loss_fn(params, buffers, batch)
            else:
                objective, out = loss_fn(params, buffers, batch)
            out = dict(out)
            out["buffers"] = T.tree_map(lambda b, d: b.to(d), out["buffers"], dtypes)
            objective = objective.to(policy.output_dtype)
            return (objective * scale if scale is not None else objective), out

        return cast_loss

    def check(self, ctx: StepContext) -> None:
        if not self.dynamic:
            return
        s: LossScaleState = ctx.slot(self)
        ctx.grads = T.tree_scale(ctx.grads, 1.0 / s.scale)
        ctx.skip_unless_finite()
        ctx.metrics["loss_scale"] = s.scale

    def commit(self, ctx: StepContext) -> None:
        if not self.dynamic:
            return
        s: LossScaleState = ctx.slot(self)
        finite = ctx.finite
        good = torch.where(finite, s.good_steps + 1, torch.zeros_like(s.good_steps))
        h = hyper_values(s.hyper, self.hyper)
        grow, up, down = good >= h["growth_interval"], h["growth_factor"], h["backoff_factor"]
        if isinstance(up, torch.Tensor):  # the state's values: in the scale's float32, as a number would be
            up, down = up.to(s.scale.dtype), down.to(s.scale.dtype)
        scale = torch.where(finite, torch.where(grow, s.scale * up, s.scale), s.scale * down)
        good = torch.where(grow, torch.zeros_like(good), good)
        if ctx.boundary is not None:  # within a streaming window the scale must not change
            scale = torch.where(ctx.boundary, scale, s.scale)
            good = torch.where(ctx.boundary, good, s.good_steps)
        ctx.set_slot(self, LossScaleState(scale, good, s.hyper))

    def __repr__(self) -> str:
        return f"mixed_precision({self.policy})"


def _policy(policy: Any) -> Policy:
    if isinstance(policy, Policy):
        return policy
    if isinstance(policy, str):
        key = policy.lower()
        if key not in _NAMES:
            raise ValueError(f"mixed_precision: unknown policy {policy!r}; use one of 'no', 'bf16', 'fp16' "
                             f"or a functrain.Policy(param_dtype, compute_dtype, output_dtype)")
        compute = _NAMES[key] or torch.float32
        return Policy(torch.float32, compute, torch.float32)
    raise TypeError(f"mixed_precision: policy must be 'no', 'bf16', 'fp16' or a functrain.Policy; "
                    f"got {type(policy).__name__}")


def mixed_precision(policy: Any = "bf16", **loss_scale: Any) -> MixedPrecision:
    """Mixed-precision compute from fp32 master params, with dynamic loss scaling for fp16.

    Args:
        policy: ``"no"`` / ``"fp32"`` (no casts), ``"bf16"`` (default), ``"fp16"``, or a :class:`Policy`.
        **loss_scale: the loss scale's settings: ``init_scale`` (> 0, default ``2**16``),
            ``growth_factor`` (>= 1, default 2.0), ``backoff_factor`` (in (0, 1), default 0.5),
            ``growth_interval`` (finite updates in a row before growing, an int >= 1, default 2000),
            ``dynamic`` (a bool; default ``None``: on for fp16 compute only).

    Returns:
        The :class:`MixedPrecision` transform (stages ``loss``, ``check``, ``commit``); its slot
        ``state.slots["mixed_precision"]`` (``state.loss_scale``) is a :class:`LossScaleState`, or
        ``None`` without a dynamic scale.

    Raises:
        ValueError: an unknown policy name.
        TypeError: a policy that is neither a name nor a :class:`Policy`, an unknown keyword, or (at
            ``init``) params not of the policy's ``param_dtype``.
        BadValue: a loss-scale setting out of its range.

    Example::

        >>> import torch, functrain as ft
        >>> step = ft.mixed_precision("fp16")(ft.train_step(lambda p, b, x: (p["w"] * x).sum(), ft.optim.sgd(0.1)))
        >>> state = step.init({"w": torch.ones(2)})
        >>> float(state.loss_scale.scale)
        65536.0
    """
    return MixedPrecision(policy, **loss_scale)
