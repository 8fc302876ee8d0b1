"""The training state: one immutable pytree holding everything that changes during training."""
from __future__ import annotations

from typing import Any, Callable, NamedTuple

import torch
from .registry import register_checkpoint_type

__all__ = ["TrainState", "register_accessor"]

# attribute -> (slot name, fn(slot) -> value, owner): the conveniences transforms declare (``state.ema``).
# Filled by ``Transform.__init_subclass__`` from each transform class's ``accessors``; state.py names no slot.
_ACCESSORS: dict[str, tuple[str, Callable[[Any], Any], str]] = {}


@register_checkpoint_type("functrain.TrainState")
class TrainState(NamedTuple):
    """Everything that changes during training, as one pytree.

    Built by ``step.init(params, buffers)``; the constructor takes the six fields below
    (a :class:`functrain.Step` fills them).

    Attributes:
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
        slots:     ``{transform name: state}``, one slot per stateful transform
                   (``"ema"``, ``"mixed_precision"``, ``"accumulate"``, ...).

    Transforms may declare read-only conveniences for their slot
    (:attr:`functrain.Transform.accessors`): ``state.ema`` (the EMA params of
    :func:`functrain.ema`) and ``state.loss_scale`` (the fp16 loss-scale state of
    :func:`functrain.mixed_precision`) are the built-in ones. Each is ``None`` when
    the state has no such slot.

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
        """A copy with the given fields replaced (``state.replace(params=new)``).

        Args:
            **changes: new values by field name (``params``, ``buffers``, ``opt_state``, ``step``,
                ``rng``, ``slots``).

        Returns:
            A new :class:`TrainState`; this one is unchanged.

        Raises:
            ValueError: a name that is not a field.

        Example::

            >>> import torch, functrain as ft
            >>> step = ft.train_step(lambda p, b, batch: (p["w"] * batch).sum(), ft.optim.sgd(0.1))
            >>> state = step.init({"w": torch.ones(3)})
            >>> int(state.replace(step=torch.tensor(5)).step), int(state.step)
            (5, 0)
        """
        return self._replace(**changes)

    def __getattr__(self, name: str) -> Any:
        # Only reached when normal lookup fails: the accessors transforms declared for their slots.
        entry = _ACCESSORS.get(name)
        if entry is None:
            raise AttributeError(f"'TrainState' object has no attribute {name!r}")
        slot = self.slots.get(entry[0])
        return None if slot is None else entry[1](slot)

    def __dir__(self) -> list[str]:
        return sorted(set(object.__dir__(self)) | set(_ACCESSORS))


def register_accessor(attr: str, slot: str, fn: Callable[[Any], Any], owner: str = "") -> None:
    """Make ``state.<attr>`` return ``fn(state.slots[slot])`` (``None`` without that slot).

    :class:`functrain.Transform` subclasses call this for their ``accessors``
    when they are defined; call it yourself only for slots kept outside a
    transform class.

    Args:
        attr: the attribute name, a public identifier that is not a field or method of the state.
        slot: the name of the slot it reads.
        fn: ``fn(slot_value) -> value``.
        owner: who declares it (default ``""``); an attribute names one slot: declaring it again
            from another owner is an error, the same owner may re-declare it (a class defined
            again in a notebook).

    Returns:
        ``None``.

    Raises:
        ValueError: a bad or shadowing name, or one already declared for another slot by another owner.
        TypeError: ``fn`` is not callable.

    Example::

        >>> from functrain.core.state import register_accessor
        >>> register_accessor("noise_count", "grad_noise", lambda slot: slot["count"])
    """
    if not isinstance(attr, str) or not attr.isidentifier() or attr.startswith("_"):
        raise ValueError(f"an accessor name must be a public identifier; got {attr!r}")
    if attr in TrainState.__dict__ or hasattr(tuple, attr):
        raise ValueError(f"accessor {attr!r} would shadow TrainState's own field or method {attr!r}")
    if not callable(fn):
        raise TypeError(f"accessor {attr!r}: fn must be callable(slot) -> value; got {type(fn).__name__}")
    known = _ACCESSORS.get(attr)
    if known is not None and known[2] != owner and (known[0], known[1]) != (slot, fn):
        raise ValueError(f"accessor state.{attr} is already declared for slot {known[0]!r}"
                         f"{f' by {known[2]}' if known[2] else ''}; pick another name")
    _ACCESSORS[attr] = (slot, fn, owner)
