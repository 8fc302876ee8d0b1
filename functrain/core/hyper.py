"""Hyper-parameters as data: the values a user changes between runs of one model live in the state.

An optimizer's lr, betas, eps and weight decay, a schedule's constants (peak, warm-up, horizon, final lr),
``clip``'s max norm, the EMA's decay and warm-up constants and the loss scale's settings are not Python
constants closed over by the step: each is a 0-dim float64 tensor in a ``hyper`` field of the state
``NamedTuple`` that uses it (``AdamState.hyper``, ``EmaState.hyper``, ``ClipState.hyper``, ...), a dict
``{name: tensor}`` that ``init`` fills from the constructor's values. A compiled step reads them as inputs of its
graph, so one graph serves every learning rate, run length, resume and sweep of the same model and shapes
(optax's ``inject_hyperparams``, as the default). What changes the graph's structure (the model, shapes, dtypes,
``accumulate(n)``, which transforms, ``momentum > 0``, ``nesterov``) stays a constructor setting.

Eagerly, :func:`values` reads a CPU state's hyper-parameters as Python floats (a host memory read, no sync), so
the eager update does ``torch.optim``'s own float arithmetic, bit for bit; traced, under ``torch.func.vmap`` (a
population, whose members hold tensors of shape ``(n,)``), or on a device, they stay tensors and the update
uses no ``float()``, ``.item()`` or Python branch on them.

:func:`set_hyper` replaces them between runs (or per member of a population); :func:`get_hyper` reads them.

Example::

    >>> import torch, functrain as ft
    >>> step = ft.clip(1.0)(ft.train_step(lambda p, b, x: (p["w"] * x).sum(), ft.optim.adam(1e-3)))
    >>> state = step.init({"w": torch.zeros(2)})
    >>> state = ft.set_hyper(state, lr=3e-4, betas=(0.9, 0.95), clip={"max_norm": 0.5})
    >>> h = ft.get_hyper(state)
    >>> float(h["lr"]), float(h["beta2"]), float(h["clip"]["max_norm"])
    (0.0003, 0.95, 0.5)
"""
from __future__ import annotations

import math
from typing import Any, Mapping

import optree
import torch

from .eager import host_number
from .validate import BadValue, describe

__all__ = ["HYPER_DTYPE", "make", "values", "set_hyper", "get_hyper", "holders", "copy_hyper"]

HYPER_DTYPE = torch.float64  # torch.optim's scalars are Python floats: doubles


def make(defaults: Mapping[str, Any], device: Any) -> dict:
    """``{name: 0-dim float64 tensor}`` on ``device`` for a tree of numbers (a schedule's constants nest).

    Example::

        >>> from functrain.core.hyper import make
        >>> make({"lr": 0.1, "lr_schedule": {"peak": 1.0}}, "cpu")["lr_schedule"]["peak"]
        tensor(1., dtype=torch.float64)
    """
    return optree.tree_map(lambda v: torch.tensor(float(v), dtype=HYPER_DTYPE, device=device), dict(defaults))


def values(hyper: Any, defaults: Mapping[str, Any]) -> dict:
    """The hyper-parameters an update uses: ``hyper`` (a state's dict) read with :func:`~functrain.core.eager.
    host_number` (Python floats for a plain CPU state eagerly, tensors otherwise), or ``defaults`` (the
    constructor's numbers) for a state saved without them (``hyper`` is ``None``).

    Example::

        >>> import torch
        >>> from functrain.core.hyper import make, values
        >>> values(make({"lr": 0.5}, "cpu"), {"lr": 0.1}), values(None, {"lr": 0.1})
        ({'lr': 0.5}, {'lr': 0.1})
    """
    if hyper is None:
        return dict(defaults)
    return optree.tree_map(host_number, hyper)


def holders(tree: Any) -> list:
    """The ``NamedTuple`` nodes of ``tree`` that hold hyper-parameters (a ``hyper`` dict field), in tree order."""
    found: list = []

    def walk(x: Any) -> None:
        if isinstance(x, tuple) and "hyper" in getattr(type(x), "_fields", ()):
            if isinstance(x.hyper, dict):
                found.append(x)
        if isinstance(x, dict):
            for v in x.values():
                walk(v)
        elif isinstance(x, (list, tuple)):
            for v in x:
                walk(v)

    walk(tree)
    return found


def _replace_in(tree: Any, fn: Any) -> Any:
    """``tree`` with every holder ``h`` replaced by ``fn(h)``: the containers on the way rebuilt, every other node
    (the params, the moments) the very object it was."""
    if isinstance(tree, tuple) and "hyper" in getattr(type(tree), "_fields", ()) and isinstance(tree.hyper, dict):
        tree = fn(tree)
    if isinstance(tree, dict):
        kids = {k: _replace_in(v, fn) for k, v in tree.items()}
        return tree if all(kids[k] is v for k, v in tree.items()) else type(tree)(kids)
    if isinstance(tree, (list, tuple)):
        kids = [_replace_in(v, fn) for v in tree]
        if all(a is b for a, b in zip(kids, tree)):
            return tree
        return type(tree)._make(kids) if hasattr(type(tree), "_fields") else type(tree)(kids)
    return tree


def _as_value(name: str, new: Any, old: torch.Tensor) -> torch.Tensor:
    """``new`` as a tensor like ``old`` (float64 on its device): a number, or a tensor (a population's ``(n,)``)."""
    if isinstance(new, torch.Tensor):
        if not (new.is_floating_point() or new.dtype in (torch.int32, torch.int64)):
            raise BadValue(f"set_hyper: {name} must be a number or a real tensor; got {describe(new)}")
        return new.detach().to(dtype=old.dtype, device=old.device)
    if isinstance(new, bool) or not isinstance(new, (int, float)) or math.isnan(float(new)):
        raise BadValue(f"set_hyper: {name} must be a number (not NaN) or a tensor; got {describe(new)}")
    return torch.tensor(float(new), dtype=old.dtype, device=old.device)


def _merge(name: str, old: Any, new: Any) -> Any:
    """``old`` (a tensor or a tree of them) with ``new`` in its place: a number/tensor for a tensor; a dict (or a
    schedule's :meth:`hyper_values`) for a tree, whose keys must be ``old``'s (a subset: the others are kept)."""
    if isinstance(old, torch.Tensor):
        if isinstance(new, Mapping):
            raise BadValue(f"set_hyper: {name} is a number in this state; got {describe(new)}")
        return _as_value(name, new, old)
    if hasattr(new, "hyper_values") and callable(new.hyper_values):  # a schedule: its constants, under its name
        new = new.hyper_values()
    if not isinstance(new, Mapping):
        raise BadValue(f"set_hyper: {name} holds {sorted(old)} in this state (a schedule's constants): give a "
                       f"schedule of the same kind or a dict of those names; got {describe(new)}")
    if len(old) == 1 and set(new) and not set(new) & set(old):  # lr={"total_steps": 4000}: the one schedule's
        (kind, inner), = old.items()
        if isinstance(inner, Mapping):
            return {kind: _merge(f"{name}.{kind}", inner, new)}
    unknown = sorted(set(new) - set(old), key=str)
    if unknown:
        raise BadValue(f"set_hyper: {name} has no {unknown} in this state; it holds {sorted(old)} (another kind of "
                       f"schedule changes the step's structure: build the step with it)")
    return {k: _merge(f"{name}.{k}", v, new[k]) if k in new else v for k, v in old.items()}


def _expand(values: Mapping[str, Any]) -> dict:
    """``betas=(b1, b2)`` as ``beta1``/``beta2`` (torch.optim's argument, the state's two names)."""
    out = dict(values)
    if "betas" in out:
        betas = out.pop("betas")
        if not isinstance(betas, (tuple, list)) or len(betas) != 2:
            raise BadValue(f"set_hyper: betas must be a pair (beta1, beta2); got {describe(betas)}")
        out.setdefault("beta1", betas[0])
        out.setdefault("beta2", betas[1])
    return out


def set_hyper(state: Any, **new: Any) -> Any:
    """A copy of ``state`` with hyper-parameters replaced: the next step uses them, and a compiled step runs
    the graph it already has (they are inputs of it, not constants).

    ``state`` is a :class:`~functrain.TrainState` or an optimizer's state. The optimizer's values are named as
    its constructor's arguments (``lr``, ``betas`` or ``beta1``/``beta2``, ``eps``, ``weight_decay``,
    ``momentum``, ...); a transform's are given as a dict under its slot's name (``clip={"max_norm": 0.5}``,
    ``ema={"decay": 0.99}``, ``mixed_precision={"growth_interval": 1000}``). A scheduled ``lr`` takes a
    schedule of the same kind (``lr=schedules.warmup_cosine(1e-3, 100, total_steps=4000)``: its constants
    replace the state's) or a dict of some of its constants (``lr={"total_steps": 4000}``). A value is a number
    or a tensor: a population (one state per member, stacked) gives a tensor of shape ``(n,)``.

    Args:
        state: a ``TrainState``, or a state ``NamedTuple`` with a ``hyper`` field (``AdamState``, ...).
        **new: the values, by name.

    Returns:
        The new state (the old one is not modified; only the replaced leaves are new tensors).

    Raises:
        BadValue: a name that nothing in ``state`` holds (the message lists what it holds), a value that is not
            a number (NaN refused) or a real tensor, a number for a schedule or a schedule of another kind.

    Example::

        >>> import torch, functrain as ft
        >>> opt = ft.optim.adamw(ft.optim.schedules.warmup_cosine(1e-3, warmup_steps=10, total_steps=400))
        >>> s = ft.set_hyper(opt.init({"w": torch.ones(2)}), lr={"total_steps": 4000}, weight_decay=0.1)
        >>> float(s.hyper["lr"]["warmup_cosine"]["total_steps"]), float(s.hyper["weight_decay"])
        (4000.0, 0.1)
    """
    new = _expand(new)
    slots = getattr(state, "slots", None) if hasattr(state, "opt_state") else None
    slot_values = {k: new.pop(k) for k in list(new) if isinstance(slots, dict) and k in slots}
    target = state.opt_state if slots is not None or hasattr(state, "opt_state") else state
    unused = set(new)

    def replace(holder: Any) -> Any:
        mine = {k: v for k, v in new.items() if k in holder.hyper}
        unused.difference_update(mine)
        return holder._replace(hyper={k: _merge(k, v, mine[k]) if k in mine else v for k, v in holder.hyper.items()})

    target = _replace_in(target, replace) if new else target
    if unused:
        held = sorted({k for h in holders(target) for k in h.hyper} | set(slots or ()))
        raise BadValue(f"set_hyper: nothing in this state holds {sorted(unused)}; it holds {held} (a slot's values "
                       f"as a dict under its name)")
    if slots is None:
        return target if not hasattr(state, "opt_state") else state._replace(opt_state=target)
    new_slots = dict(slots)
    for name, vals in slot_values.items():
        if not isinstance(vals, Mapping):
            raise BadValue(f"set_hyper: the {name!r} slot's values are given as a dict, e.g. {name}={{...}}; got "
                           f"{describe(vals)}")
        found = holders(slots[name])
        if not found:
            raise BadValue(f"set_hyper: the {name!r} slot holds no hyper-parameters")
        vals = _expand(vals)
        missing = set(vals) - {k for h in found for k in h.hyper}
        if missing:
            raise BadValue(f"set_hyper: the {name!r} slot has no {sorted(missing)}; it holds "
                           f"{sorted({k for h in found for k in h.hyper})}")
        new_slots[name] = _replace_in(slots[name], lambda h, vals=vals: h._replace(hyper={
            k: _merge(f"{name}.{k}", v, vals[k]) if k in vals else v for k, v in h.hyper.items()}))
    return state._replace(opt_state=target, slots=new_slots)


def get_hyper(state: Any) -> dict:
    """The hyper-parameters ``state`` holds: the optimizer's by name, each slot's as a dict under its name.

    Returns the state's tensors themselves (``float(...)`` them to read a value on the host).

    Example::

        >>> import torch, functrain as ft
        >>> state = ft.train_step(lambda p, b, x: (p["w"] * x).sum(), ft.optim.sgd(0.1)).init({"w": torch.ones(1)})
        >>> {k: float(v) for k, v in ft.get_hyper(state).items()}
        {'lr': 0.1, 'weight_decay': 0.0}
    """
    out: dict = {}
    opt = state.opt_state if hasattr(state, "opt_state") else state
    for h in holders(opt):
        out.update(h.hyper)
    for name, slot in (getattr(state, "slots", None) or {}).items() if hasattr(state, "opt_state") else ():
        found = holders(slot)
        if found:
            out[name] = {k: v for h in found for k, v in h.hyper.items()}
    return out


def copy_hyper(state: Any, source: Any) -> Any:
    """``state`` with every ``hyper`` field taken from ``source`` (a state of the same step, e.g. a fresh
    ``step.init``): a resumed run whose configuration says other numbers (a longer run, another lr) trains with the
    configuration's, not the checkpoint's. The holders are matched in tree order; their structure must agree.

    Raises:
        ValueError: the two states do not hold the same hyper-parameters (another step's state).

    Example::

        >>> import torch, functrain as ft
        >>> from functrain.core.hyper import copy_hyper
        >>> old = ft.optim.adam(1e-3).init({"w": torch.ones(1)})
        >>> float(copy_hyper(old, ft.optim.adam(3e-4).init({"w": torch.ones(1)})).hyper["lr"])
        0.0003
    """
    new = iter(holders(source))
    count = [len(holders(state))]

    def take(holder: Any) -> Any:
        other = next(new, None)
        if other is None or optree.tree_structure(other.hyper) != optree.tree_structure(holder.hyper):
            raise ValueError(f"copy_hyper: the states hold different hyper-parameters: {sorted(holder.hyper)} and "
                             f"{None if other is None else sorted(other.hyper)}")
        return holder._replace(hyper=optree.tree_map(
            lambda x, y: y.detach().to(dtype=x.dtype, device=x.device).clone(), holder.hyper, other.hyper))

    out = _replace_in(state, take)
    if next(new, None) is not None or count[0] != len(holders(source)):
        raise ValueError("copy_hyper: the states hold different hyper-parameters (another step's state?)")
    return out
