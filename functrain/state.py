"""The training state: one immutable pytree holding everything that changes during training."""
from __future__ import annotations

from typing import Any, NamedTuple

import torch
from .registry import register_checkpoint_type

__all__ = ["TrainState"]


@register_checkpoint_type("functrain.TrainState")
class TrainState(NamedTuple):
    """Everything that changes during training, as one pytree.

    Fields:
        params:    the trainable parameters (a pytree of floating tensors, usually a
                   ``{name: tensor}`` dict from :func:`functrain.functionalize`).
        buffers:   non-trainable module state (BatchNorm statistics, ...); the step
                   returns the buffers as the forward pass left them.
        opt_state: the optimizer's state (its ``count`` is the number of updates applied).
        step:      an int64 scalar tensor, the number of steps called. It is a tensor
                   so that a compiled step never recompiles as it advances.
        rng:       ``{"key": int64 host tensor [seed, counter]}``: each step derives its
                   random seed (dropout, noise) from it and advances the counter, so
                   re-running a step from the same state draws the same numbers.
                   ``None`` if the step is not seeded (torch's global RNG is used).
        slots:     ``{transform name: state}``, one slot per transform (``"ema"``,
                   ``"mixed_precision"``, ``"accumulate"``, ...).

    The state is a ``NamedTuple``: optree flattens it natively and ``torch.compile``
    traces it without graph breaks. It is never changed in place; a step returns a
    new one, and :meth:`replace` makes modified copies.

    Example::

        >>> import torch, functrain as ft
        >>> step = ft.train_step(lambda p, b, batch: (p["w"] * batch).sum(), ft.optim.sgd(0.1))
        >>> state = step.init({"w": torch.ones(3)})
        >>> int(state.step), sorted(state.params)
        (0, ['w'])
    """

    params: Any
    buffers: Any
    opt_state: Any
    step: torch.Tensor
    rng: Any
    slots: dict

    def replace(self, **changes: Any) -> "TrainState":
        """A copy with the given fields replaced (``state.replace(params=new)``)."""
        return self._replace(**changes)

    @property
    def ema(self) -> Any:
        """The EMA parameters kept by :func:`functrain.ema`, or ``None`` without that transform."""
        slot = self.slots.get("ema")
        return None if slot is None else slot.params

    @property
    def loss_scale(self) -> Any:
        """The dynamic loss-scale state of ``mixed_precision("fp16")``, or ``None``."""
        return self.slots.get("mixed_precision")
