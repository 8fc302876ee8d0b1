"""Learning-rate schedules: pure tensor functions ``schedule(count) -> lr``.

``count`` is the int64 step tensor of an optimizer state (the number of updates
already taken), so update ``t`` (0-based) uses ``schedule(t)``, as with
``torch.optim.lr_scheduler.LambdaLR``. Each schedule returns a float64 scalar
tensor on ``count``'s device and uses no Python control flow on tensor values,
so it traces under ``torch.compile(fullgraph=True)``. Python ints are accepted
for ``count`` too, for convenience.

A schedule that ends (decays to a final value) carries its horizon as the
attribute ``schedule.total_steps``: the number of updates it was built for
(``None`` for one that goes on forever, such as :func:`constant` or
:func:`linear_warmup`). :func:`check_covers` refuses a run longer than that
horizon before training starts: past it every update would use the final lr.
Your own schedule may set ``.total_steps`` to take part; without the attribute
it is taken to cover any run.

Example::

    >>> from functrain.optim import schedules
    >>> s = schedules.warmup_cosine(1.0, warmup_steps=10, total_steps=110)
    >>> [round(float(s(t)), 3) for t in (0, 5, 10, 60, 110, 200)]
    [0.0, 0.5, 1.0, 0.5, 0.0, 0.0]
"""
from __future__ import annotations

import math
from typing import Any, Callable, Sequence

import torch

from .base import Optimizer, Schedule, check_real, check_steps, describe
from .base import count_f64 as _count

__all__ = [
    "constant", "linear_warmup", "linear_decay", "cosine_decay", "warmup_cosine", "warmup_linear_decay",
    "join", "scale", "horizon", "check_covers", "Schedule",
]


def _v(like: torch.Tensor, x: Any) -> torch.Tensor:
    """A constant as a float64 tensor like ``like``: a number filled in, a (state's) tensor as it is."""
    return x.to(like.dtype) if isinstance(x, torch.Tensor) else torch.full_like(like, x)


def _frac(c: torch.Tensor, steps: Any) -> torch.Tensor:
    """``clamp(c, 0, steps) / steps`` (``steps`` >= 1): the same ops on a number as on a state's tensor, whose
    denominator is kept >= 1 so that a value set to 0 gives no NaN."""
    if isinstance(steps, torch.Tensor):
        return torch.minimum(c.clamp(min=0), steps) / steps.clamp(min=1)
    return c.clamp(0, steps) / steps


def _ends(schedule: Schedule, total_steps: int | None) -> Schedule:
    """Mark ``schedule`` with its horizon (see the module docstring)."""
    schedule.total_steps = total_steps
    return schedule


def _check_schedule(name: str, schedule: Any) -> Schedule:
    if not callable(schedule) or isinstance(schedule, torch.Tensor):
        raise TypeError(f"{name} must be a schedule callable(count) -> lr; got {describe(schedule)}")
    return schedule


def _constant(c: torch.Tensor, k: dict) -> torch.Tensor:
    return _v(c, k["value"])


def constant(value: float) -> Schedule:
    """Always ``value``.

    Args:
        value: the learning rate, a finite float.

    Returns:
        A schedule ``callable(count) -> lr`` (a float64 scalar tensor on ``count``'s device); ``.total_steps`` is ``None`` (it never ends).

    Raises:
        BadValue: (a ``TypeError`` and a ``ValueError``) for a value that is not a finite float or a step count that is not an int >= 0, naming it.

    Example::

        >>> from functrain.optim.schedules import constant
        >>> float(constant(0.1)(1000))
        0.1
    """
    value = check_real("constant: value", value)
    return Schedule("constant", {"value": value}, _constant, None)


def _linear_warmup(c: torch.Tensor, k: dict) -> torch.Tensor:
    steps = k["warmup_steps"]
    if not isinstance(steps, torch.Tensor):  # a number: decided here (0 steps: the peak from the start)
        if steps == 0:
            return _v(c, k["peak"])
        frac = _frac(c, steps)
    else:  # the state's value: 0 is a select, no branch
        frac = torch.where(steps > 0, _frac(c, steps), torch.ones_like(c))
    # lerp returns exactly ``start`` at 0 and exactly ``peak`` at 1.
    return torch.lerp(_v(c, k["start"]), _v(c, k["peak"]), frac)


def linear_warmup(peak: float, warmup_steps: int, start: float = 0.0) -> Schedule:
    """Linear from ``start`` (at count 0) to ``peak`` (at ``warmup_steps``), then ``peak``.

    Args:
        peak: the lr reached at ``warmup_steps`` and kept after, a finite float.
        warmup_steps: the number of updates of the warmup, an int >= 0 (0: :func:`constant` ``peak``).
        start: the lr at count 0, a finite float (default 0.0).

    Returns:
        A schedule ``callable(count) -> lr`` (a float64 scalar tensor on ``count``'s device); ``.total_steps`` is ``None`` (it never ends).

    Raises:
        BadValue: (a ``TypeError`` and a ``ValueError``) for a value that is not a finite float or a step count that is not an int >= 0, naming it.

    Example::

        >>> from functrain.optim.schedules import linear_warmup
        >>> s = linear_warmup(1.0, warmup_steps=4)
        >>> [float(s(t)) for t in range(6)]
        [0.0, 0.25, 0.5, 0.75, 1.0, 1.0]
    """
    peak = check_real("linear_warmup: peak", peak)
    start = check_real("linear_warmup: start", start)
    warmup_steps = check_steps("linear_warmup: warmup_steps", warmup_steps)
    return Schedule("linear_warmup", {"peak": peak, "warmup_steps": warmup_steps, "start": start},
                    _linear_warmup, None)


def _cosine_decay(c: torch.Tensor, k: dict) -> torch.Tensor:
    weight = 0.5 * (1 + torch.cos(math.pi * _frac(c, k["decay_steps"])))
    return torch.lerp(_v(c, k["final"]), _v(c, k["peak"]), weight)


def cosine_decay(peak: float, decay_steps: int, final: float = 0.0) -> Schedule:
    """Half a cosine from ``peak`` (at count 0) to ``final`` (at ``decay_steps``), then ``final``.

    Args:
        peak: the lr at count 0, a finite float.
        decay_steps: the number of updates of the decay, an int >= 1.
        final: the lr at ``decay_steps`` and after, a finite float (default 0.0).

    Returns:
        A schedule ``callable(count) -> lr`` (a float64 scalar tensor on ``count``'s device); ``.total_steps`` is ``decay_steps``.

    Raises:
        BadValue: (a ``TypeError`` and a ``ValueError``) for a value that is not a finite float or a step count that is not an int >= 1, naming it.

    Example::

        >>> from functrain.optim.schedules import cosine_decay
        >>> s = cosine_decay(1.0, decay_steps=10, final=0.1)
        >>> [round(float(s(t)), 6) for t in (0, 5, 10, 11)]
        [1.0, 0.55, 0.1, 0.1]
    """
    peak = check_real("cosine_decay: peak", peak)
    final = check_real("cosine_decay: final", final)
    decay_steps = check_steps("cosine_decay: decay_steps", decay_steps, minimum=1)
    return Schedule("cosine_decay", {"peak": peak, "decay_steps": decay_steps, "final": final}, _cosine_decay,
                    decay_steps)


def _linear_decay(c: torch.Tensor, k: dict) -> torch.Tensor:
    # lerp returns exactly ``peak`` at 0 and exactly ``final`` at 1.
    return torch.lerp(_v(c, k["peak"]), _v(c, k["final"]), _frac(c, k["decay_steps"]))


def linear_decay(peak: float, decay_steps: int, final: float = 0.0) -> Schedule:
    """Linear from ``peak`` (at count 0) to ``final`` (at ``decay_steps``), then ``final``.

    Args:
        peak: the lr at count 0, a finite float.
        decay_steps: the number of updates of the decay, an int >= 1.
        final: the lr at ``decay_steps`` and after, a finite float (default 0.0).

    Returns:
        A schedule ``callable(count) -> lr`` (a float64 scalar tensor on ``count``'s device); ``.total_steps`` is ``decay_steps``.

    Raises:
        BadValue: (a ``TypeError`` and a ``ValueError``) for a value that is not a finite float or a step count that is not an int >= 1, naming it.

    Example::

        >>> from functrain.optim.schedules import linear_decay
        >>> s = linear_decay(1.0, decay_steps=4, final=0.2)
        >>> [round(float(s(t)), 6) for t in range(6)]
        [1.0, 0.8, 0.6, 0.4, 0.2, 0.2]
    """
    peak = check_real("linear_decay: peak", peak)
    final = check_real("linear_decay: final", final)
    decay_steps = check_steps("linear_decay: decay_steps", decay_steps, minimum=1)
    return Schedule("linear_decay", {"peak": peak, "decay_steps": decay_steps, "final": final}, _linear_decay,
                    decay_steps)


def warmup_cosine(
    peak: float, warmup_steps: int, total_steps: int, final: float = 0.0, start: float = 0.0
) -> Schedule:
    """Linear warmup from ``start`` to ``peak`` over ``warmup_steps``, then cosine decay to
    ``final`` at ``total_steps`` (which counts the warmup), then ``final``.

    Its five constants are the state's (``state.opt_state.hyper["lr"]["warmup_cosine"]``): a compiled step
    built for 400 steps runs a 4,000-step run after ``ft.set_hyper(state, lr={"total_steps": 4000})``.

    Args:
        peak: the lr at the end of the warmup, a finite float.
        warmup_steps: the number of updates of the warmup, an int >= 0.
        total_steps: the update at which ``final`` is reached, an int > ``warmup_steps``.
        final: the lr at ``total_steps`` and after, a finite float (default 0.0).
        start: the lr at count 0, a finite float (default 0.0).

    Returns:
        A schedule ``callable(count) -> lr`` (a float64 scalar tensor on ``count``'s device); ``.total_steps`` is ``total_steps``.

    Raises:
        BadValue: (a ``TypeError`` and a ``ValueError``) for a value that is not a finite float or a step count that is not an int >= 0, naming it.
        ValueError: ``total_steps <= warmup_steps``.

    Example::

        >>> from functrain.optim.schedules import warmup_cosine
        >>> s = warmup_cosine(1.0, warmup_steps=2, total_steps=6)
        >>> [round(float(s(t)), 6) for t in range(8)]
        [0.0, 0.5, 1.0, 0.853553, 0.5, 0.146447, 0.0, 0.0]
    """
    return _warmup_then("warmup_cosine", _cosine_decay, peak, warmup_steps, total_steps, final, start)


def warmup_linear_decay(
    peak: float, warmup_steps: int, total_steps: int, final: float = 0.0, start: float = 0.0
) -> Schedule:
    """Linear warmup from ``start`` to ``peak`` over ``warmup_steps``, then linear decay to
    ``final`` at ``total_steps`` (which counts the warmup), then ``final`` (the
    Hugging Face "linear" schedule when ``final=0``).

    Args:
        peak: the lr at the end of the warmup, a finite float.
        warmup_steps: the number of updates of the warmup, an int >= 0.
        total_steps: the update at which ``final`` is reached, an int > ``warmup_steps``.
        final: the lr at ``total_steps`` and after, a finite float (default 0.0).
        start: the lr at count 0, a finite float (default 0.0).

    Returns:
        A schedule ``callable(count) -> lr`` (a float64 scalar tensor on ``count``'s device); ``.total_steps`` is ``total_steps``.

    Raises:
        BadValue: (a ``TypeError`` and a ``ValueError``) for a value that is not a finite float or a step count that is not an int >= 0, naming it.
        ValueError: ``total_steps <= warmup_steps``.

    Example::

        >>> from functrain.optim.schedules import warmup_linear_decay
        >>> s = warmup_linear_decay(1.0, warmup_steps=2, total_steps=6)
        >>> [float(s(t)) for t in range(8)]
        [0.0, 0.5, 1.0, 0.75, 0.5, 0.25, 0.0, 0.0]
        >>> s.total_steps
        6
    """
    return _warmup_then("warmup_linear_decay", _linear_decay, peak, warmup_steps, total_steps, final, start)


def _warmup_then(name: str, decay: Callable[[torch.Tensor, dict], torch.Tensor], peak: float, warmup_steps: int,
                 total_steps: int, final: float, start: float) -> Schedule:
    """A linear warmup to ``peak``, then ``decay`` from ``peak`` to ``final`` over ``total_steps - warmup_steps``:
    the checks and the join the ``warmup_*`` schedules share, as one schedule of five constants."""
    peak = check_real(f"{name}: peak", peak)
    final = check_real(f"{name}: final", final)
    start = check_real(f"{name}: start", start)
    warmup_steps = check_steps(f"{name}: warmup_steps", warmup_steps)
    total_steps = check_steps(f"{name}: total_steps", total_steps)
    if total_steps <= warmup_steps:
        raise ValueError(f"{name}: total_steps must be > warmup_steps={warmup_steps}; got {describe(total_steps)}")

    def formula(c: torch.Tensor, k: dict) -> torch.Tensor:
        w = k["warmup_steps"]
        warm = _linear_warmup(c, {"peak": k["peak"], "warmup_steps": w, "start": k["start"]})
        cool = decay(c - w, {"peak": k["peak"], "decay_steps": k["total_steps"] - w, "final": k["final"]})
        return torch.where(c < w, warm, cool)

    constants = {"peak": peak, "warmup_steps": warmup_steps, "total_steps": total_steps, "final": final,
                 "start": start}
    return Schedule(name, constants, formula, total_steps)


def join(schedules: Sequence[Schedule], boundaries: Sequence[int]) -> Schedule:
    """Run ``schedules[0]`` until ``boundaries[0]``, then ``schedules[1]`` with the count
    restarted at 0 (``count - boundaries[0]``), and so on (Optax's ``join_schedules``).

    The boundaries and the constants of the schedules that are :class:`Schedule` objects are data
    (``constants["boundaries"]``, ``constants["schedules"]``); a plain callable is called as it is.

    Args:
        schedules: a non-empty list or tuple of schedules ``callable(count) -> lr``.
        boundaries: a list or tuple of ``len(schedules) - 1`` non-decreasing ints >= 0: the count at
            which each next schedule starts.

    Returns:
        A schedule ``callable(count) -> lr`` (a float64 scalar tensor on ``count``'s device); ``.total_steps`` is the last schedule's horizon plus the last boundary (``None`` if the
        last schedule never ends).

    Raises:
        TypeError: ``schedules`` is not a non-empty list of callables, or ``boundaries`` not a list.
        ValueError: the number of boundaries is not ``len(schedules) - 1``, or they decrease.

    Example::

        >>> from functrain.optim.schedules import join, constant, linear_warmup
        >>> s = join([constant(1.0), linear_warmup(2.0, 2, start=1.0)], boundaries=[3])
        >>> [float(s(t)) for t in range(6)]
        [1.0, 1.0, 1.0, 1.0, 1.5, 2.0]
    """
    if not isinstance(schedules, (list, tuple)) or not schedules:
        raise TypeError(f"join: schedules must be a non-empty list of schedules; got {describe(schedules)}")
    schedules = [_check_schedule(f"join: schedules[{i}]", s) for i, s in enumerate(schedules)]
    if not isinstance(boundaries, (list, tuple)):
        raise TypeError(f"join: boundaries must be a list of ints; got {describe(boundaries)}")
    if len(boundaries) != len(schedules) - 1:
        raise ValueError(
            f"join: needs len(schedules) - 1 = {len(schedules) - 1} boundaries; got {len(boundaries)}: "
            f"{list(boundaries)!r}"
        )
    boundaries = [check_steps(f"join: boundaries[{i}]", b) for i, b in enumerate(boundaries)]
    if any(b > c for b, c in zip(boundaries, boundaries[1:])):
        raise ValueError(f"join: boundaries must be non-decreasing; got {boundaries!r}")
    kids = {str(i): s.constants for i, s in enumerate(schedules) if isinstance(s, Schedule)}

    def at(s: Any, i: int, count: torch.Tensor, k: dict) -> torch.Tensor:
        return _count(s.at(count, k["schedules"][str(i)]) if isinstance(s, Schedule) else s(count))

    def formula(c: torch.Tensor, k: dict) -> torch.Tensor:
        out = at(schedules[0], 0, c, k)
        for i, sched in enumerate(schedules[1:]):
            boundary = k["boundaries"][str(i)]
            out = torch.where(c < boundary, out, at(sched, i + 1, c - boundary, k))
        return out

    last = horizon(schedules[-1])
    return Schedule("join", {"schedules": kids, "boundaries": {str(i): b for i, b in enumerate(boundaries)}},
                    formula, None if last is None else last + (boundaries[-1] if boundaries else 0))


def scale(schedule: Schedule, factor: float) -> Schedule:
    """``schedule(count) * factor``.

    Args:
        schedule: a schedule ``callable(count) -> lr``.
        factor: a finite float.

    Returns:
        A schedule ``callable(count) -> lr`` (a float64 scalar tensor on ``count``'s device), with ``schedule``'s horizon.

    Raises:
        TypeError: ``schedule`` is not callable.

    Example::

        >>> from functrain.optim.schedules import scale, linear_warmup
        >>> float(scale(linear_warmup(1.0, 4), 0.1)(2))
        0.05
    """
    schedule = _check_schedule("scale: schedule", schedule)
    factor = check_real("scale: factor", factor)
    inner = schedule.constants if isinstance(schedule, Schedule) else {}

    def formula(c: torch.Tensor, k: dict) -> torch.Tensor:
        value = schedule.at(c, k["schedule"]) if isinstance(schedule, Schedule) else schedule(c)
        return _count(value) * k["factor"]

    return Schedule("scale", {"schedule": inner, "factor": factor}, formula, horizon(schedule))


def _lr_of(obj: Any) -> Any:
    """A functrain optimizer's declared lr (its ``schedule`` field: a float, a schedule or ``None``), else
    ``obj`` itself."""
    return obj.schedule if isinstance(obj, Optimizer) else obj


def horizon(schedule: Any) -> int | None:
    """The number of updates a schedule was built for (its ``total_steps`` attribute).

    Args:
        schedule: a schedule, a float lr, or a functrain :class:`~functrain.optim.Optimizer` (whose
            declared ``schedule`` is read).

    Returns:
        ``schedule.total_steps`` as an int, or ``None`` if it goes on forever (a float lr,
        :func:`constant`, :func:`linear_warmup`, or a callable without that attribute).

    Example::

        >>> from functrain.optim import adamw, schedules
        >>> schedules.horizon(schedules.warmup_cosine(1.0, 10, 1000)), schedules.horizon(0.1)
        (1000, None)
        >>> schedules.horizon(adamw(lr=schedules.cosine_decay(1e-3, 500)))
        500
    """
    schedule = _lr_of(schedule)
    if not callable(schedule) or isinstance(schedule, torch.Tensor):
        return None
    total = getattr(schedule, "total_steps", None)
    if total is None:
        return None
    return check_steps("schedule.total_steps", total)


def check_covers(schedule: Any, total_steps: int) -> None:
    """Refuse a schedule that ends before a run of ``total_steps`` updates does.

    Update ``t`` (0-based) uses ``schedule(t)``, so a schedule built for ``H`` updates
    covers runs of at most ``H`` updates; a longer run would spend updates
    ``H .. total_steps - 1`` at the final lr (often 0), which is almost always a config
    mistake (a ``total_steps`` left over from a shorter run). Schedules without a
    horizon (see :func:`horizon`) pass.

    Args:
        schedule: a schedule, a float lr or a functrain optimizer (its lr is checked).
        total_steps: the number of updates of the run, an int >= 0.

    Returns:
        ``None`` when the schedule covers the run.

    Raises:
        ValueError: the schedule ends before the run does; the message names both lengths and the final lr.

    Example::

        >>> from functrain.optim import schedules
        >>> s = schedules.warmup_cosine(1e-3, warmup_steps=10, total_steps=100)
        >>> schedules.check_covers(s, 100)
        >>> schedules.check_covers(s, 150)
        Traceback (most recent call last):
        ...
        ValueError: the lr schedule was built for 100 updates (total_steps=100) but the run takes 150: updates 100..149 would all use its final lr 0; build it with total_steps >= 150
    """
    total_steps = check_steps("check_covers: total_steps", total_steps)
    end = horizon(schedule)
    if end is None or total_steps <= end:
        return
    final = float(_count(_lr_of(schedule)(end)))
    raise ValueError(
        f"the lr schedule was built for {end} updates (total_steps={end}) but the run takes {total_steps}: "
        f"updates {end}..{total_steps - 1} would all use its final lr {final:g}; build it with "
        f"total_steps >= {total_steps}"
    )
