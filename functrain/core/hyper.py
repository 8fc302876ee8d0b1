"""Hyper-parameters as data: the values a user changes between runs of one model live in the state.

An optimizer's lr, betas, eps and weight decay, a schedule's constants (peak, warm-up, horizon, final lr),
``clip``'s max norm, the EMA's decay and warm-up constants and the loss scale's settings are not Python
constants closed over by the step: they are float64 values in a ``hyper`` field of the state ``NamedTuple`` that
uses them (``AdamState.hyper``, ``EmaState.hyper``, ``ClipState.hyper``, ...), which ``init`` fills from the
constructor's values. The field is ``{names: tensor}``: one float64 tensor of the values, keyed by their names
joined (``"beta1;beta2;eps;lr;weight_decay"``), so the names are the state's structure and the values one input
of a compiled graph (:func:`make`; :func:`get_hyper` gives them by name). A compiled step reads them as inputs, so
one graph serves every learning rate, run length, resume and sweep of the same model and shapes (optax's
``inject_hyperparams``, as the default). What changes the graph's structure (the model, shapes, dtypes,
``accumulate(n)``, which transforms, the kind of schedule, ``momentum > 0``, ``weight_decay > 0``, ``nesterov``)
stays a constructor setting.

Eagerly, :func:`values` reads a CPU state's hyper-parameters as Python floats (one host memory read, no sync), so
the eager update does ``torch.optim``'s own float arithmetic, bit for bit; traced, under ``torch.func.vmap`` (a
population, whose members hold a tensor of shape ``(n, k)``), or on a device, they are 0-dim tensors and the update
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

from .eager import tracing
from .tree import find_nodes
from .validate import BadValue, describe

__all__ = ["HYPER_DTYPE", "make", "to_device", "values", "pack", "unpack", "set_hyper", "get_hyper", "holders", "copy_hyper",
           "hyper_changes"]

HYPER_DTYPE = torch.float64  # torch.optim's scalars are Python floats: doubles
SEP, PATH_SEP = ";", "/"  # between names, and between a nested name's parts (lr/warmup_cosine/peak)


def _key(paths: list) -> str:
    """The names of a holder's values, in optree's (sorted) order, as one string: the packed tensor's dict key, so
    that the names are part of the state's structure (its treespec) and the values one leaf."""
    return SEP.join(PATH_SEP.join(map(str, p)) for p in paths)


def make(defaults: Mapping[str, Any], device: Any) -> dict:
    """The ``hyper`` field for ``defaults`` (a tree of numbers: a schedule's constants nest): ``{names: values}``,
    one float64 tensor of the values in optree's order, keyed by their names joined (``"beta1;beta2;eps;lr"``).

    One leaf, not one per value: a compiled call pays per input (each is checked and passed), and a 0-dim float64
    CPU tensor is read by Dynamo's fake tensors as a Python float, which restarts its analysis once per graph.

    Example::

        >>> from functrain.core.hyper import make
        >>> make({"lr": 0.1, "sched": {"peak": 1.0}}, "cpu")
        {'lr;sched/peak': tensor([0.1000, 1.0000], dtype=torch.float64)}
    """
    paths, leaves, _ = optree.tree_flatten_with_path(dict(defaults))
    if device is not None and torch.device(device).type == "meta":  # params built there (ft.init_empty): the
        device = "cpu"  # values are known, so they are real; to_device moves them where the state is made real
    return {_key(paths): torch.tensor([float(v) for v in leaves], dtype=HYPER_DTYPE, device=device)}


def to_device(tree: Any, device: Any) -> Any:
    """``tree`` with every holder's hyper-parameters on ``device`` (a state built from params on the meta device
    holds them on the CPU until it is made real: :func:`make`)."""
    return _replace_in(tree, lambda h: h._replace(hyper={k: v.to(device) for k, v in h.hyper.items()}))


def _readable(x: torch.Tensor) -> bool:
    """Whether ``x`` is read on the host for free and safely (the conditions of :func:`~functrain.core.eager.
    host_number`, for a 1-D tensor): a plain CPU tensor, eagerly, outside any dispatch mode or functorch transform."""
    return (type(x) is torch.Tensor and x.is_cpu and x.dim() == 1 and not tracing()
            and not torch._C._len_torch_dispatch_stack() and not torch._C._functorch.is_functorch_wrapped_tensor(x))


def values(hyper: Any, defaults: Mapping[str, Any]) -> dict:
    """The hyper-parameters an update uses, as the tree ``defaults`` is: the state's ``hyper`` read as Python floats
    for a plain CPU state eagerly (one host read), else as 0-dim tensors (traced, on a device, a population's
    member under ``vmap``); or ``defaults`` (the constructor's numbers) for a state saved without them (``None``).

    Raises:
        ValueError: the state holds other names than ``defaults`` (another optimizer's state).

    Example::

        >>> import torch
        >>> from functrain.core.hyper import make, values
        >>> values(make({"lr": 0.5}, "cpu"), {"lr": 0.1}), values(None, {"lr": 0.1})
        ({'lr': 0.5}, {'lr': 0.1})
    """
    if hyper is None:
        return dict(defaults)
    (key, vec), = hyper.items()
    paths = _paths(defaults)
    if key != _key(paths):
        raise ValueError(f"this state's hyper-parameters are {key.split(SEP)}, the step's {_key(paths).split(SEP)}: "
                         f"a state of another optimizer or transform")
    numbers = vec.tolist() if _readable(vec) else vec.unbind(-1)
    out: dict = {}
    for path, x in zip(paths, numbers):
        node = out
        for part in path[:-1]:
            node = node.setdefault(part, {})
        node[path[-1]] = x
    return out


def _paths(tree: Mapping[str, Any], prefix: tuple = ()) -> list:
    """The paths to the numbers of a tree of dicts, in optree's order (sorted keys): plain Python, which Dynamo
    traces as constants (optree's path flattening it cannot)."""
    out: list = []
    for k in sorted(tree):
        v = tree[k]
        out.extend(_paths(v, prefix + (k,)) if isinstance(v, Mapping) else [prefix + (k,)])
    return out


def unpack(hyper: dict) -> dict:
    """A holder's ``hyper`` field as a tree ``{name: tensor}`` (views of the packed tensor; a schedule's nest)."""
    (key, vec), = hyper.items()
    out: dict = {}
    for i, name in enumerate(key.split(SEP)):
        *outer, last = name.split(PATH_SEP)
        node = out
        for part in outer:
            node = node.setdefault(part, {})
        node[last] = vec[..., i]
    return out


def pack(tree: dict) -> dict:
    """The ``hyper`` field for a tree of tensors (:func:`unpack`'s inverse; the values broadcast to one shape: a
    population's ``(n,)`` next to a shared value)."""
    paths, leaves, _ = optree.tree_flatten_with_path(tree)
    shape = torch.broadcast_shapes(*(x.shape for x in leaves))
    return {_key(paths): torch.stack([x.expand(shape) for x in leaves], -1)}


def holders(tree: Any) -> list:
    """The ``NamedTuple`` nodes of ``tree`` that hold hyper-parameters (a ``hyper`` dict field), in tree order."""
    return find_nodes(tree, lambda x: isinstance(x, tuple) and "hyper" in getattr(type(x), "_fields", ())
                      and isinstance(x.hyper, dict))


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
    return torch.full(old.shape, float(new), dtype=old.dtype, device=old.device)


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
        >>> h = ft.get_hyper(s)
        >>> float(h["lr"]["warmup_cosine"]["total_steps"]), float(h["weight_decay"])
        (4000.0, 0.1)
    """
    new = _expand(new)
    slots = getattr(state, "slots", None) if hasattr(state, "opt_state") else None
    slot_values = {k: new.pop(k) for k in list(new) if isinstance(slots, dict) and k in slots}
    target = state.opt_state if slots is not None or hasattr(state, "opt_state") else state
    unused = set(new)

    def replace(holder: Any) -> Any:
        held = unpack(holder.hyper)
        mine = {k: v for k, v in new.items() if k in held}
        unused.difference_update(mine)
        return holder._replace(hyper=pack({k: _merge(k, v, mine[k]) if k in mine else v for k, v in held.items()}))

    target = _replace_in(target, replace) if new else target
    if unused:
        held = sorted({k for h in holders(target) for k in unpack(h.hyper)} | set(slots or ()))
        hint = ("; a weight_decay of 0 at construction is the step's structure (no decay term in the graph): build "
                "the optimizer with a weight_decay > 0 to set it between runs, 0 included" if "weight_decay" in unused
                else "")
        raise BadValue(f"set_hyper: nothing in this state holds {sorted(unused)}; it holds {held} (a slot's values "
                       f"as a dict under its name){hint}")
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
        missing = set(vals) - {k for h in found for k in unpack(h.hyper)}
        if missing:
            raise BadValue(f"set_hyper: the {name!r} slot has no {sorted(missing)}; it holds "
                           f"{sorted({k for h in found for k in unpack(h.hyper)})}")
        new_slots[name] = _replace_in(slots[name], lambda h, vals=vals: h._replace(hyper=pack({
            k: _merge(f"{name}.{k}", v, vals[k]) if k in vals else v for k, v in unpack(h.hyper).items()})))
    return state._replace(opt_state=target, slots=new_slots)


def get_hyper(state: Any) -> dict:
    """The hyper-parameters ``state`` holds: the optimizer's by name, each slot's as a dict under its name.

    Returns views of the state's tensors (``float(...)`` one to read a value on the host).

    Example::

        >>> import torch, functrain as ft
        >>> state = ft.train_step(lambda p, b, x: (p["w"] * x).sum(), ft.optim.sgd(0.1, weight_decay=1e-4)).init({"w": torch.ones(1)})
        >>> {k: float(v) for k, v in ft.get_hyper(state).items()}
        {'lr': 0.1, 'weight_decay': 0.0001}
    """
    out: dict = {}
    opt = state.opt_state if hasattr(state, "opt_state") else state
    for h in holders(opt):
        out.update(unpack(h.hyper))
    for name, slot in (getattr(state, "slots", None) or {}).items() if hasattr(state, "opt_state") else ():
        found = holders(slot)
        if found:
            out[name] = {k: v for h in found for k, v in unpack(h.hyper).items()}
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
        >>> float(ft.get_hyper(copy_hyper(old, ft.optim.adam(3e-4).init({"w": torch.ones(1)})))["lr"])
        0.0003
    """
    new = iter(holders(source))
    count = [len(holders(state))]

    def take(holder: Any) -> Any:
        other = next(new, None)
        if other is None or set(other.hyper) != set(holder.hyper):
            raise ValueError(f"copy_hyper: the states hold different hyper-parameters: {sorted(unpack(holder.hyper))} "
                             f"and {None if other is None else sorted(unpack(other.hyper))}")
        return holder._replace(hyper=optree.tree_map(
            lambda x, y: y.detach().to(dtype=x.dtype, device=x.device).clone(), holder.hyper, other.hyper))

    out = _replace_in(state, take)
    if next(new, None) is not None or count[0] != len(holders(source)):
        raise ValueError("copy_hyper: the states hold different hyper-parameters (another step's state?)")
    return out


def hyper_changes(old: Any, new: Any) -> dict:
    """The hyper-parameters whose values differ between two states of one step: ``{"lr.warmup_cosine.total_steps":
    (400.0, 4000.0), ...}`` (dotted names as :func:`get_hyper` nests them, host floats; a population's tensors
    compared whole, shown as lists). What a resume that :func:`copy_hyper` the configuration's values changes.

    Example::

        >>> import torch, functrain as ft
        >>> from functrain.core.hyper import hyper_changes
        >>> a = ft.optim.adam(1e-3).init({"w": torch.ones(1)})
        >>> hyper_changes(a, ft.set_hyper(a, lr=3e-4))
        {'lr': (0.001, 0.0003)}
    """
    def flat(state: Any) -> dict:
        paths, leaves, _ = optree.tree_flatten_with_path(get_hyper(state))
        return {".".join(map(str, p)): x for p, x in zip(paths, leaves)}

    def host(x: Any) -> Any:
        x = x.detach().cpu()
        return float(x) if x.numel() == 1 else x.tolist()

    a, b = flat(old), flat(new)
    return {k: (host(a[k]), host(b[k])) for k in a if k in b and host(a[k]) != host(b[k])}
