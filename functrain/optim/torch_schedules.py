"""``torch.optim.lr_scheduler`` schedulers as functrain schedules: one lr table per param group.

A torch scheduler is a stateful object that rewrites ``group["lr"]`` after each
update; most of its formulas are *chainable* (``StepLR``, ``CosineAnnealingLR``,
``LinearLR`` multiply the previous lr), so a closed-form schedule would differ from
it in the last bits. Here the scheduler itself is run, on a copy bound to a stand-in
for its optimizer (the real optimizer, its params and the scheduler are untouched),
and each param group's lr of every update is written into a table: update ``t`` uses
``table[t]``, the very float ``group["lr"]`` holds before torch's ``optimizer.step()``
of update ``t``. ``LambdaLR`` (what ``transformers.get_scheduler`` builds) is computed
directly as torch computes it, ``base_lr * lr_lambda(t)`` on the host, which is faster
than stepping it.

The table is what traces under ``torch.compile(fullgraph=True)`` (an index into a
constant tensor): a Python ``lr_lambda`` cannot run on a traced step counter. So a
table needs a length, its *horizon* (``schedule.total_steps``, read by
:func:`functrain.optim.schedules.check_covers`): the run's number of updates when
given (``num_steps``), else the scheduler's own end (``OneCycleLR.total_steps``,
``CosineAnnealingLR.T_max``, a ``transformers`` schedule's ``num_training_steps``;
``LinearLR``/``ConstantLR``/``PolynomialLR``/``MultiStepLR`` and a ``SequentialLR``
ending in one are constant after their last change and cover any run). A scheduler
with neither (``StepLR``, ``ExponentialLR``, a ``LambdaLR`` of your own lambda) needs
``num_steps``. From update ``total_steps`` on, a table gives its last lr, as
functrain's own schedules give their final lr.
"""
from __future__ import annotations

import copy
import functools
import math
from typing import Any

import torch
from torch.optim import lr_scheduler as L

from ..core.eager import host_number, tracing
from .base import check_steps, describe

__all__ = ["TorchLRSchedule", "from_torch_scheduler"]

# constant after their total_iters
_CONSTANT_AFTER = (L.LinearLR, L.ConstantLR, L.PolynomialLR)


class TorchLRSchedule:
    """One param group's lr per update, read from a ``torch.optim.lr_scheduler`` (a table).

    A functrain schedule: ``schedule(count)`` is the lr of update ``count`` (0-based), a
    float64 scalar tensor; it traces under ``torch.compile(fullgraph=True)``.

    Attributes:
        values: the lrs of updates ``start .. start + len(values) - 1`` (Python floats, torch's own).
        start: the first update the table covers (the scheduler's ``last_epoch`` when translated).
        total_steps: the horizon (:func:`functrain.optim.schedules.horizon`): ``start + len(values)``,
            or ``None`` when the lr is constant after the table's last entry (the table then covers
            any run).
        name: the scheduler and group it came from, for messages.

    Example::

        >>> from functrain.optim.torch_schedules import TorchLRSchedule
        >>> s = TorchLRSchedule([0.1, 0.05], start=0, total_steps=2, name="StepLR group 0")
        >>> float(s(0)), float(s(1)), float(s(7))        # past the end: the last lr
        (0.1, 0.05, 0.05)
    """

    def __init__(self, values: list[float], start: int, total_steps: int | None, name: str) -> None:
        if not values:
            raise ValueError(f"{name}: an lr table needs at least one value")
        self.values = [float(v) for v in values]
        self.start = int(start)
        self.total_steps = total_steps
        self.name = name
        self._tables: dict[torch.device, torch.Tensor] = {}  # the table per device, made eagerly once

    def __repr__(self) -> str:
        return (f"TorchLRSchedule({self.name}, updates {self.start}..{self.start + len(self.values) - 1}, "
                f"total_steps={self.total_steps})")

    def _table(self, device: torch.device) -> torch.Tensor:
        table = self._tables.get(device)
        if table is None:
            table = torch.tensor(self.values, dtype=torch.float64, device=device)
            if not tracing():  # a table made while tracing is the trace's constant, not this object's
                self._tables[device] = table
        return table

    def __call__(self, count: Any) -> torch.Tensor:
        n = host_number(count)
        if not isinstance(n, torch.Tensor):  # eagerly (a host counter, an int): the float itself
            value = self.values[min(max(int(n) - self.start, 0), len(self.values) - 1)]
            return torch.tensor(value, dtype=torch.float64)
        table = self._table(count.device)
        index = (count - self.start).clamp(0, len(self.values) - 1).reshape(1)
        return table.index_select(0, index).reshape(())  # (indexing with a 0-d tensor reads it on the host)


class _StandIn:
    """What a scheduler copy steps instead of the real optimizer: copies of its param groups (no params)."""

    _opt_called = True  # torch's "lr_scheduler.step() before optimizer.step()" check: not applicable here

    def __init__(self, groups: list[dict]) -> None:
        self.param_groups = [{k: copy.deepcopy(v) for k, v in g.items() if k != "params"} for g in groups]
        self.step = _Step()


class _Step:
    _wrapped_by_lr_sched = True  # torch's check that optimizer.step was not replaced after the scheduler

    def __call__(self, *args: Any, **kwargs: Any) -> None:
        return None


def _kind(scheduler: Any) -> str:
    return type(scheduler).__name__


def _hf_end(scheduler: Any) -> int | None:
    """A ``transformers`` schedule's ``num_training_steps`` (its lambdas are ``functools.partial`` objects)."""
    ends = [fn.keywords.get("num_training_steps") for fn in scheduler.lr_lambdas if isinstance(fn, functools.partial)]
    ends = [e for e in ends if isinstance(e, int) and not isinstance(e, bool)]
    return max(ends) if ends else None


def _end(scheduler: Any) -> tuple[int | None, bool]:
    """``(the update the scheduler ends at, constant after it)`` counted from its construction."""
    if isinstance(scheduler, L.OneCycleLR):
        return scheduler.total_steps, False
    if isinstance(scheduler, (L.LambdaLR, L.MultiplicativeLR)):
        return _hf_end(scheduler), False
    if isinstance(scheduler, L.CosineAnnealingLR):
        return scheduler.T_max, False
    if isinstance(scheduler, _CONSTANT_AFTER):
        return scheduler.total_iters + 1, True
    if isinstance(scheduler, L.MultiStepLR):
        return max(scheduler.milestones, default=0) + 1, True
    if isinstance(scheduler, L.SequentialLR):
        end, constant = _end(scheduler._schedulers[-1])
        return (None, False) if end is None else (scheduler._milestones[-1] + end, constant)
    if isinstance(scheduler, L.ChainedScheduler):
        ends = [_end(s) for s in scheduler._schedulers]
        if all(constant for _, constant in ends):
            return max(end for end, _ in ends), True
    return None, False


def _last_epoch(scheduler: Any) -> int:
    """How many times ``scheduler`` has stepped (a ``ChainedScheduler``'s children step together)."""
    if isinstance(scheduler, L.ChainedScheduler):
        return _last_epoch(scheduler._schedulers[0])
    return int(scheduler.last_epoch)


def _lambda_values(scheduler: Any, start: int, length: int) -> list[list[float]]:
    """``LambdaLR`` as torch's ``get_lr`` computes it: ``base_lr * lr_lambda(t)``, per group."""
    rows = []
    for i, (fn, base) in enumerate(zip(scheduler.lr_lambdas, scheduler.base_lrs)):
        row = []
        for t in range(start, start + length):
            value = base * fn(t)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"LambdaLR group {i}: base_lr * lr_lambda({t}) must be a finite number (a float "
                                 f"lr); got {describe(value)}")
            row.append(float(value))
        rows.append(row)
    return rows


def _stepped_values(scheduler: Any, torch_opt: Any, length: int) -> list[list[float]]:
    """Step a copy of ``scheduler`` bound to a stand-in of its optimizer; refuse one that changes more than the lr."""
    stand_in = _StandIn(torch_opt.param_groups)
    twin = copy.deepcopy(scheduler, memo={id(torch_opt): stand_in})
    before = [{k: v for k, v in g.items() if k not in ("lr", "initial_lr")} for g in stand_in.param_groups]
    rows: list[list[float]] = [[] for _ in stand_in.param_groups]
    for t in range(length):
        for i, (g, b) in enumerate(zip(stand_in.param_groups, before)):
            rows[i].append(g["lr"])
            changed = sorted(k for k in b if g.get(k) != b[k])  # every update: a cycle may come back
            if changed:
                hint = ("; build it with cycle_momentum=False" if isinstance(scheduler, (L.OneCycleLR, L.CyclicLR))
                        else "")
                raise ValueError(f"{_kind(scheduler)} changes {', '.join(repr(k) for k in changed)} of param group "
                                 f"{i} as it steps (e.g. {changed[0]!r}: {b[changed[0]]!r} -> {g.get(changed[0])!r} "
                                 f"at update {t}); functrain translates lr schedules only, its optimizers hold the "
                                 f"other hyper-parameters fixed{hint}")
        if t < length - 1:
            twin.step()
    for i, row in enumerate(rows):
        for t, v in enumerate(row):
            if isinstance(v, torch.Tensor) or isinstance(v, bool) or not isinstance(v, (int, float)):
                raise TypeError(f"{_kind(scheduler)} set param group {i}'s lr to {describe(v)}; functrain translates "
                                f"float lrs (give the optimizer lr=<float>, not a tensor)")
    return rows


def from_torch_scheduler(scheduler: Any, num_steps: int | None = None) -> list[TorchLRSchedule]:
    """The lr of each param group of ``scheduler``'s optimizer, per update, as functrain schedules.

    Update ``t`` of a functrain optimizer built with ``lr=schedules[i]`` uses the lr that
    torch's group ``i`` holds for its update ``t`` (its optimizer and ``scheduler.step()``
    called once per update): the same floats, bit for bit. The scheduler, its optimizer and
    the params are left as they are. A scheduler that has stepped ``k`` times (its
    ``last_epoch``) continues from update ``k``.

    Args:
        scheduler: a ``torch.optim.lr_scheduler.LRScheduler`` (``LambdaLR``, ``StepLR``,
            ``CosineAnnealingLR``, ``OneCycleLR``, ``SequentialLR``, a ``transformers.get_scheduler``
            schedule, ...); not ``ReduceLROnPlateau``, which follows a metric.
        num_steps: the run's number of updates, the table's horizon; ``None`` (default): the
            scheduler's own end (see the module docstring), an error for one without an end.

    Returns:
        A list of :class:`TorchLRSchedule`, one per param group, in the optimizer's group order.

    Raises:
        TypeError: ``scheduler`` is not a torch scheduler, or it sets a tensor lr.
        ValueError: it is ``ReduceLROnPlateau``, it has no end and ``num_steps`` is ``None``, it has
            passed its end already, or it changes another hyper-parameter than the lr (``OneCycleLR``'s
            ``cycle_momentum``).

    Example::

        >>> import torch
        >>> from functrain.optim import from_torch_scheduler
        >>> torch_opt = torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=1.0)
        >>> sched = torch.optim.lr_scheduler.StepLR(torch_opt, step_size=2, gamma=0.5)
        >>> s, = from_torch_scheduler(sched, num_steps=6)
        >>> [float(s(t)) for t in range(6)], s.total_steps
        ([1.0, 1.0, 0.5, 0.5, 0.25, 0.25], 6)
    """
    if isinstance(scheduler, L.ReduceLROnPlateau):
        raise ValueError("ReduceLROnPlateau follows a metric you pass to its step(metric), which a pure step cannot "
                         "see; functrain translates schedulers that are functions of the update count (StepLR, "
                         "CosineAnnealingLR, OneCycleLR, LambdaLR, ...)")
    if not isinstance(scheduler, L.LRScheduler):
        raise TypeError(f"scheduler must be a torch.optim.lr_scheduler.LRScheduler; got {describe(scheduler)}")
    if num_steps is not None:
        num_steps = check_steps("num_steps", num_steps, minimum=1)
    torch_opt = scheduler.optimizer
    for i, g in enumerate(torch_opt.param_groups):
        if isinstance(g["lr"], torch.Tensor):
            raise TypeError(f"param group {i} of {type(torch_opt).__name__} has a tensor lr ({describe(g['lr'])}); "
                            "functrain translates float lrs: build it with lr=<float>")
    start = _last_epoch(scheduler)
    end, constant = _end(scheduler)
    if constant:
        total, length = None, max(end - start, 1)
    elif num_steps is not None:
        total = num_steps if end is None or not isinstance(scheduler, L.OneCycleLR) else min(num_steps, end)
        length = total - start
    elif end is not None:
        total, length = end, end - start
    else:
        raise ValueError(f"{_kind(scheduler)} has no end of its own, and an lr table that traces needs one: give the "
                         f"run's number of updates, ft.optim.from_torch(optimizer, scheduler=scheduler, num_steps=N) "
                         f"(the Trainer passes its train_num_steps)")
    if length < 1:
        raise ValueError(f"{_kind(scheduler)} has stepped {start} times already (last_epoch={start}), past its "
                         f"horizon of {total} updates: nothing of it is left to translate")
    if type(scheduler) is L.LambdaLR:
        rows = _lambda_values(scheduler, start, length)
    else:
        rows = _stepped_values(scheduler, torch_opt, length)
    return [TorchLRSchedule(row, start, total, f"{_kind(scheduler)} group {i}") for i, row in enumerate(rows)]
