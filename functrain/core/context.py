"""What a transform's hooks read and write: :class:`StepContext` (one step, running or traced) and
:class:`InitContext` (what ``post_init`` may know of the other transforms).

Kept apart from :mod:`functrain.core.step` (the stage table, ``Step`` and the ``Transform`` protocol)
because they are the data a step passes its transforms, not the pipeline itself.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from . import tree as T
from .state import TrainState

__all__ = ["StepContext", "InitContext"]


class StepContext:
    """What a transform's hooks read and write while one step runs (or is traced).

    Attributes (all tensors live on the device):
        state:    the input :class:`TrainState` (never modified).
        batch:    the batch given to the step.
        params, buffers, opt_state: current values; after ``update`` the new ones.
        grads:    the gradient pytree (sum form before ``normalise``).
        loss, denom, aux, weight: the summed loss, its denominator, the summed aux
                  metrics and how many micro-batches contributed to them. ``denom``
                  and ``weight`` are Python floats while they are known without
                  running the step (no ``num_items``), tensors otherwise.
        finite:   ``None`` or a bool scalar: were the loss and gradients finite?
        apply:    ``None`` or a bool scalar: is this step's update kept? (see :meth:`keep_if`)
        boundary: ``None`` or a bool scalar: does this call end an update window?
                  (streaming accumulation sets it; loss scaling only adapts there)
        metrics:  the dict returned to the caller.
        shard_sum: ``None``, or (while ``grads`` is one rank's shard) sums a tensor over shards: :meth:`global_sum`
    """

    def __init__(self, state: TrainState, batch: Any):
        self.state = state
        self.batch = batch
        self.params = state.params
        self.buffers = state.buffers
        self.opt_state = state.opt_state
        self.slots = dict(state.slots)
        self.grads: Any = None
        self.loss: Any = None
        self.denom: Any = None
        self.aux: dict = {}
        self.weight: Any = None
        self.finite: torch.Tensor | None = None
        self.apply: torch.Tensor | None = None
        self.boundary: torch.Tensor | None = None
        self.metrics: dict = {}
        self.shard_sum: Callable[[torch.Tensor], torch.Tensor] | None = None  # set by sharded data_parallel
        self._loss_fn: Callable | None = None   # the loss stage's result, differentiated by the grad stage
        self._counts_items = False              # the loss is a sum over aux["num_items"] items
        self._before_update: tuple = ()         # (params, opt_state) the commit stage falls back to

    def slot(self, transform: "Transform") -> Any:
        """The transform's slot as it is now in this step."""
        return self.slots[transform.name]

    def set_slot(self, transform: "Transform", value: Any) -> None:
        """Set the transform's slot in the new state."""
        self.slots[transform.name] = value

    def keep_if(self, pred: torch.Tensor) -> None:
        """Keep this step's update only where ``pred`` (a bool scalar tensor) holds.

        Predicates from several transforms are and-ed; the ``commit`` stage then
        selects new or old params and optimizer state on the device.
        """
        self.apply = pred if self.apply is None else self.apply & pred

    def global_sum(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` summed over the gradient's shards (an in-graph all-reduce while ``grads`` is one rank's shard, else
        ``x``): how a transform reads a global property of the gradient, e.g. ``ctx.global_sum(sq).sqrt()``."""
        return x if self.shard_sum is None else self.shard_sum(x)

    def skip_unless_finite(self) -> torch.Tensor:
        """Drop this step's update unless the loss and the gradients, as they are now, are finite.

        The one "skip a non-finite update" rule, shared by every transform that
        needs it (``skip_nonfinite``, fp16 loss scaling): and-s the result into
        :attr:`finite`, keeps the update only where it holds (:meth:`keep_if`) and
        sets ``metrics["skipped"]``. Returns this check's own bool scalar. Call it
        in the ``check`` stage, after unscaling.

        Example (a transform's ``check`` hook)::

            def check(self, ctx):
                finite = ctx.skip_unless_finite()
                ctx.set_slot(self, {"bad": ctx.slot(self)["bad"] + (~finite).to(torch.int64)})
        """
        bad = self.global_sum((~T.tree_all_finite(self.grads)).to(torch.float32))  # shards: any rank's counts
        finite = (bad == 0) & torch.isfinite(self.metrics["loss"])
        self.finite = finite if self.finite is None else self.finite & finite
        self.keep_if(finite)
        self.metrics["skipped"] = ~self.finite
        return finite


class InitContext:
    """What ``Transform.post_init`` may read about the step being initialised: the other transforms'
    declarations, never the transforms themselves.

    Attributes:
        params_fields: ``{slot name: field names}`` from each stateful transform's
            :attr:`Transform.params_fields` (only slots that declare some).
    """

    __slots__ = ("params_fields",)

    def __init__(self, params_fields: dict[str, tuple[str, ...]]):
        self.params_fields = params_fields

    def map_params_like(self, slots: dict, fn: Callable[[Any], Any]) -> dict:
        """``slots`` with ``fn(tree)`` in place of each declared params-shaped field (new containers;
        the other fields are the same objects)."""
        out = dict(slots)
        for name, fields in self.params_fields.items():
            if name in out:
                out[name] = _replace_fields(out[name], fields, fn)
        return out


def _replace_fields(slot: Any, fields: tuple[str, ...], fn: Callable[[Any], Any]) -> Any:
    if isinstance(slot, tuple) and hasattr(slot, "_fields"):  # a NamedTuple slot
        return slot._replace(**{f: fn(getattr(slot, f)) for f in fields})
    if isinstance(slot, dict):
        return {k: fn(v) if k in fields else v for k, v in slot.items()}
    raise TypeError(f"params_fields {fields!r}: the slot is a {type(slot).__name__}; declared fields need a "
                    f"NamedTuple or dict slot")
