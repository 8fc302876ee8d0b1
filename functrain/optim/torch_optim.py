"""Your ``torch.optim`` optimizer, translated: ``ft.train_step(loss_fn, torch.optim.AdamW(model.parameters()))``.

:func:`from_torch` turns a ``torch.optim`` optimizer instance (and its lr scheduler) into a
functrain optimizer. ``SGD``, ``Adam``, ``AdamW`` and ``schedulefree.AdamWScheduleFree``
become their functional ports, each torch param group its own port built with the group's
hyper-parameters (:mod:`functrain.optim.partition`), so the updates are torch's, bit for bit
in eager float32; any other optimizer runs its own ``step()`` through the escape hatch
(:func:`functrain.optim.torch_step`). An optimizer that has stepped hands its state over
(moments, momentum buffers, schedule-free's ``z``, the step count).

The optimizer holds the model's ``Parameter`` objects; the functional params are named
(``ft.functionalize(model)`` gives ``{"fc.weight": ...}``). Which name each torch param is
comes, in this order, from ``params=`` (the module, or its ``named_parameters()``), from the
names torch keeps when the optimizer was built from ``model.named_parameters()``, or, at
``init``, from the params given to it: ``ft.functionalize`` returns detached views that share
each ``Parameter``'s memory, and a param is matched to the leaf at the same address, shape,
stride and dtype. The automatic path (``ft.train_step(loss_fn, torch_optimizer)``, the
Trainer's ``optimizer=``) uses the last two.
"""
from __future__ import annotations

from typing import Any

import optree
import torch
from torch.optim import lr_scheduler as L

from ..core.flat import is_flat
from ..core.optimizer import register_adapter
from ..core.step import Step
from .adam import adam, adamw
from .base import Optimizer, describe, make_learning_rate
from .partition import GroupedState, grouped_eval, grouped_init, grouped_update, named_leaves
from .schedulefree import adamw_schedulefree
from .sgd import sgd
from .torch_names import match_names, named_params
from .torch_schedules import from_torch_scheduler
from .torch_step import torch_step

__all__ = ["from_torch", "eval_params"]

_SF = "schedulefree.AdamWScheduleFree"
# the state tensors a stepped torch optimizer hands over: functrain field -> torch state key
_FIELDS = {"sgd": {"momentum_buffer": "momentum_buffer"}, "adam": {"exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq"},
           _SF: {"z": "z", "exp_avg_sq": "exp_avg_sq"}}
_FLOATS = {"sgd": ("lr", "momentum", "dampening", "weight_decay"), "adam": ("lr", "eps", "weight_decay"),
           _SF: ("lr", "eps", "weight_decay", "r", "weight_lr_power")}


def _kind(torch_opt: torch.optim.Optimizer) -> str | None:
    cls = type(torch_opt)
    if cls is torch.optim.SGD:
        return "sgd"
    if cls in (torch.optim.Adam, torch.optim.AdamW):
        return "adam"
    if cls.__name__ == "AdamWScheduleFree" and cls.__module__.split(".")[0] == "schedulefree":
        return _SF
    return None


def _port(kind: str, where: str, group: dict, lr: Any) -> Optimizer:
    """Group ``group``'s functional port, refusing by name what the port does not hold."""
    for key in _FLOATS[kind] + ("betas",) * (kind != "sgd"):
        values = group[key] if key == "betas" else (group[key],)
        if any(isinstance(v, torch.Tensor) for v in values):
            raise TypeError(f"{where}: {key} is a tensor ({describe(group[key])}); functrain translates Python float "
                            f"hyper-parameters: build the optimizer with {key}=<float>")
    try:
        if kind == "sgd":
            opt = sgd(lr, momentum=group["momentum"], nesterov=group["nesterov"], weight_decay=group["weight_decay"],
                      dampening=group["dampening"])
        elif kind == "adam":
            if group["amsgrad"]:
                raise ValueError("amsgrad=True: functrain's adam/adamw have no AMSGrad variant (the max of the second "
                                 "moments); build it with amsgrad=False, or run it by its own step(): "
                                 "ft.optim.torch_step(optimizer)")
            make = adamw if group.get("decoupled_weight_decay", False) else adam
            opt = make(lr, betas=group["betas"], eps=group["eps"], weight_decay=group["weight_decay"])
        else:
            opt = adamw_schedulefree(lr, betas=group["betas"], eps=group["eps"], weight_decay=group["weight_decay"],
                                     warmup_steps=group["warmup_steps"], r=group["r"],
                                     weight_lr_power=group["weight_lr_power"])
    except (TypeError, ValueError) as error:
        raise type(error)(f"{where}: {error}") from None
    if group.get("maximize", False):  # torch negates the gradients first, exactly
        inner = opt
        opt = inner._replace(update=lambda grads, state, params: inner.update(
            optree.tree_map(torch.neg, grads), state, params))
    return opt


def _handover(torch_opt: torch.optim.Optimizer, kind: str, cls: str, scheduler: Any,
              stepped: int | None) -> tuple[int, list, list]:
    """``(count, per group and param {field: tensor}, per group scalars)`` of a stepped optimizer's state."""
    seeds, scalars, steps, holders, empty = [], [], set(), [], []
    for i, group in enumerate(torch_opt.param_groups):
        row = []
        for j, p in enumerate(group["params"]):
            state = torch_opt.state.get(p, {})
            got = {f: state[k] for f, k in _FIELDS[kind].items() if isinstance(state.get(k), torch.Tensor)}
            if kind == "adam" and "step" in state:
                steps.add(int(state["step"]))
            if p.requires_grad:  # a frozen param has no gradient, so no state, in torch either
                (holders if got else empty).append((i, j))
            row.append(got)
        seeds.append(row)
        if kind == _SF:
            scalars.append({"weight_sum": float(group["weight_sum"]), "lr_max": float(group["lr_max"])})
            steps.add(int(group["k"]))
    if holders and empty:
        raise ValueError(f"{cls} has stepped, but param {empty[0][1]} of param group {empty[0][0]} has no state while "
                         f"param {holders[0][1]} of group {holders[0][0]} has (its gradient was None on some steps); "
                         f"functrain steps every param together: hand over an optimizer whose params all have state, "
                         f"or a fresh one")
    if len(steps) > 1:
        raise ValueError(f"{cls}'s params have stepped different numbers of times ({sorted(steps)}); functrain keeps "
                         f"one count for all: hand over a fresh optimizer, or one whose params all stepped together")
    if kind == _SF and holders and not all(g["train_mode"] for g in torch_opt.param_groups):
        raise ValueError(f"{cls} has stepped and is in eval mode (its params hold the averaged x): call "
                         f"optimizer.train() before handing it over, so its params hold y, where its state continues")
    count = steps.pop() if steps else 0
    if stepped is not None:  # how many times the scheduler has stepped (its last_epoch)
        if kind == "sgd":
            count = stepped
        elif count != stepped:
            raise ValueError(f"{type(scheduler).__name__} has stepped {stepped} times (last_epoch) but "
                             f"{cls} {count} times: hand them over as they are after the same number of updates")
    elif kind == "sgd" and holders:
        count = 1  # SGD keeps no step count: its momentum buffers say it has stepped
    return count, seeds, scalars


def _seed(state: Any, names: list[str | None], seeds: list[dict], scalars: dict | None, count: int,
          cls: str) -> Any:
    """``state`` (a port's state over named leaves) with the handed-over tensors, scalars and count."""
    by_name = {n: s for n, s in zip(names, seeds) if n is not None}
    fields = {}
    for field, tree in zip(state._fields, state):
        if tree is None or isinstance(tree, torch.Tensor):  # no buffers, the count, a scalar (below)
            continue
        leaf_names, leaves, spec = named_leaves(tree)
        new = []
        for n, leaf in zip(leaf_names, leaves):
            given = by_name.get(n, {}).get(field)
            if given is None:
                new.append(leaf)
                continue
            if given.shape != leaf.shape or given.dtype != leaf.dtype:
                raise ValueError(f"{cls}'s state {field!r} of param {n!r} is {tuple(given.shape)} {given.dtype}, but "
                                 f"the param is {tuple(leaf.shape)} {leaf.dtype}")
            new.append(given.detach().to(leaf.device, copy=True))
        fields[field] = optree.tree_unflatten(spec, new)
    if scalars:
        fields.update({k: torch.tensor(v, dtype=torch.float64, device=state.count.device) for k, v in scalars.items()})
    return state._replace(count=torch.full_like(state.count, count), **fields)


class _Translated:
    """The functrain optimizer of one torch.optim optimizer: names resolved once, state laid out at init."""

    def __init__(self, torch_opt: torch.optim.Optimizer, kind: str, subs: list[Optimizer], names: Any,
                 handover: tuple[int, list, list]) -> None:
        self.cls = type(torch_opt).__name__
        self.torch_groups = [list(g["params"]) for g in torch_opt.param_groups]
        self.kind, self.subs, self.names, self.handover = kind, subs, names, handover
        self.seeded = any(s for row in handover[1] for s in row) or handover[0] != 0

    def _names(self, params: Any) -> list[list[str | None]]:
        if self.names is None:  # the first init: match the optimizer's Parameters to the leaves by memory
            leaf_names, leaves, _ = named_leaves(params)
            self.names = match_names(self.torch_groups, list(zip(leaf_names, leaves)), "the params given to init",
                                self.cls)
        return self.names

    def init(self, params: Any) -> Any:
        if is_flat(params):
            if self.names is None or len(self.subs) > 1 or self.seeded:
                raise ValueError(f"{self.cls} translated: these params are flat (init(flat=True) or a sharded "
                                 f"data_parallel: one buffer per dtype, no names); only a single param group over "
                                 f"every param, named with ft.optim.from_torch(torch_optimizer, model) and without a "
                                 f"handed-over state, runs on them")
            return self.subs[0].init(params)
        names = self._names(params)
        leaf_names = named_leaves(params)[0]
        known = set(leaf_names)
        missing = [n for g in names for n in g if n is not None and n not in known]
        if missing:
            raise ValueError(f"{self.cls}'s params {missing[:6]} are not among the params given to init "
                             f"({leaf_names[:6]}...)")
        groups = [[n for n in g if n is not None] for g in names]
        count, seeds, scalars = self.handover
        if len(groups) == 1 and set(groups[0]) == known:
            return _seed(self.subs[0].init(params), names[0], seeds[0], scalars[0] if scalars else None, count,
                         self.cls)
        state = grouped_init(self.subs, groups, params)
        subs = tuple(_seed(s, names[i], seeds[i], scalars[i] if scalars else None, count, self.cls)
                     for i, s in enumerate(state.groups))
        return GroupedState(count=torch.full_like(state.count, count), groups=subs)

    def _groups(self) -> list[list[str]]:
        if self.names is None:
            raise RuntimeError(f"{self.cls} translated: call init(params) (step.init) before update, in this process")
        return [[n for n in g if n is not None] for g in self.names]

    def update(self, grads: Any, state: Any, params: Any) -> tuple[Any, Any]:
        if isinstance(state, GroupedState):
            return grouped_update(self.subs, self._groups(), grads, state, params)
        return self.subs[0].update(grads, state, params)

    def eval_params(self, params: Any, state: Any) -> Any:
        fns = [s.eval_params for s in self.subs]
        if isinstance(state, GroupedState):
            return grouped_eval(fns, self._groups(), params, state)
        return fns[0](params, state)


def from_torch(torch_optimizer: torch.optim.Optimizer, params: Any = None, *, scheduler: Any = None,
               num_steps: int | None = None) -> Optimizer:
    """A functrain optimizer that updates as ``torch_optimizer`` (with ``scheduler``) does.

    ``SGD`` (momentum, nesterov, dampening, weight_decay, maximize), ``Adam``/``AdamW``
    (betas, eps, weight_decay, maximize, ``decoupled_weight_decay``) and
    ``schedulefree.AdamWScheduleFree`` become functional ports, one per param group with that
    group's hyper-parameters: bit for bit torch's updates in eager float32 (against torch's
    for-loop and foreach implementations; ``fused=True`` kernels may round differently). What a port
    does not hold is refused by name (``amsgrad=True``, a tensor lr). Any other optimizer class
    (or a subclass) runs its own ``step()``: :func:`functrain.optim.torch_step`. A stepped
    optimizer hands its state over; the optimizer, its params and the scheduler are not changed.

    Args:
        torch_optimizer: a ``torch.optim.Optimizer`` instance over the model's parameters.
        params: which name each of its params is: the module, a dict ``{name: tensor}`` or
            ``model.named_parameters()``; ``None`` (default): the names torch kept (an optimizer built
            from ``named_parameters()``), else matched at ``init`` with the params given there, which must
            then be the model's own (``ft.functionalize(model)``'s views of its Parameters).
        scheduler: its ``torch.optim.lr_scheduler`` scheduler, or ``None``: each group's lr per update
            becomes a table (:func:`functrain.optim.from_torch_scheduler`).
        num_steps: the run's number of updates: the horizon of a scheduler without an end of its own.

    Returns:
        An :class:`~functrain.optim.Optimizer`. Its state is the port's (``AdamState``, ...) when one
        param group holds every param, else a :class:`~functrain.optim.partition.GroupedState` with one
        state per group. ``learning_rate`` reports group 0's lr; ``eval_params`` is set for schedule-free.

    Raises:
        TypeError: not a torch.optim optimizer instance, a tensor hyper-parameter, or bad ``params``.
        ValueError: an option the port does not hold, a param no name is found for, a scheduler of
            another optimizer, or a state that cannot be handed over (see the message).

    Example::

        >>> import torch, functrain as ft
        >>> model = torch.nn.Linear(3, 1)
        >>> torch_opt = torch.optim.AdamW([{"params": [model.weight]}, {"params": [model.bias], "weight_decay": 0.0}],
        ...                               lr=1e-3)
        >>> opt = ft.optim.from_torch(torch_opt, model)
        >>> apply_fn, params, buffers = ft.functionalize(model)
        >>> state = opt.init(params)
        >>> type(state).__name__, sorted(state.groups[1].exp_avg)
        ('GroupedState', ['bias'])
    """
    if not isinstance(torch_optimizer, torch.optim.Optimizer):
        raise TypeError(f"from_torch: torch_optimizer must be a torch.optim.Optimizer instance; got "
                        f"{describe(torch_optimizer)[:100]}")
    if scheduler is not None:
        if not isinstance(scheduler, (L.LRScheduler, L.ReduceLROnPlateau)):
            raise TypeError(f"from_torch: scheduler must be a torch.optim.lr_scheduler scheduler or None; got "
                            f"{describe(scheduler)[:100]}")
        if scheduler.optimizer is not torch_optimizer:
            raise ValueError(f"from_torch: the {type(scheduler).__name__} given schedules another optimizer "
                             f"({type(scheduler.optimizer).__name__}), not this {type(torch_optimizer).__name__}")
    kind = _kind(torch_optimizer)
    if kind is None:
        return torch_step(torch_optimizer, params, scheduler=scheduler, num_steps=num_steps)
    cls = f"{type(torch_optimizer).__module__}.{type(torch_optimizer).__qualname__}"
    lrs: list[Any] = [g["lr"] for g in torch_optimizer.param_groups]
    if scheduler is not None:
        lrs = list(from_torch_scheduler(scheduler, num_steps=num_steps))
    subs = [_port(kind, f"{cls} param group {i}", g, lr)
            for i, (g, lr) in enumerate(zip(torch_optimizer.param_groups, lrs))]
    handover = _handover(torch_optimizer, kind, cls, scheduler, lrs[0].start if scheduler is not None else None)
    torch_groups = [list(g["params"]) for g in torch_optimizer.param_groups]
    named = named_params(params, "from_torch")
    names = None
    if named is not None:
        names = match_names(torch_groups, named, "the named params given", cls)
    elif all("param_names" in g for g in torch_optimizer.param_groups):
        names = [[n if p.requires_grad else None for n, p in zip(g["param_names"], g["params"])]
                 for g in torch_optimizer.param_groups]
    t = _Translated(torch_optimizer, kind, subs, names, handover)
    covered = None if named is None else {n for g in (names or []) for n in g if n is not None}
    partial = covered is not None and covered != {n for n, p in named if p.requires_grad}
    return Optimizer(init=t.init, update=t.update, learning_rate=make_learning_rate(lrs[0]),
                     per_param=len(subs) > 1 or partial, schedule=lrs[0],
                     eval_params=t.eval_params if kind == _SF else None)


def eval_params(step: Any, state: Any) -> Any:
    """The weights to evaluate: ``state.params``, or what the optimizer says they are (schedule-free's ``x``).

    Schedule-free AdamW trains at ``y`` and evaluates at ``x`` (the ``schedulefree`` package's
    ``optimizer.eval()``); for every other optimizer the params are the weights.

    Args:
        step: the :class:`~functrain.Step` (or ``ft.compile``'s ``CompiledStep``, or the optimizer itself).
        state: the :class:`~functrain.TrainState`.

    Returns:
        A params tree shaped like ``state.params`` (new tensors for schedule-free; ``state.params`` else).

    Example::

        >>> import torch, functrain as ft
        >>> model = torch.nn.Linear(2, 1)
        >>> apply_fn, params, buffers = ft.functionalize(model)
        >>> step = ft.train_step(lambda p, b, x: apply_fn(p, b, x).sum(), ft.optim.adamw_schedulefree(0.1))
        >>> state = step.init(params, buffers)
        >>> for _ in range(2):
        ...     state, _ = step(state, torch.randn(4, 2))
        >>> x = ft.optim.eval_params(step, state)
        >>> bool((x["weight"] != state.params["weight"]).all())
        True
    """
    from ..compiler.api import CompiledStep
    if isinstance(step, CompiledStep):
        step = step.step
    optimizer = step.optimizer if isinstance(step, Step) else step
    if not isinstance(optimizer, Optimizer):
        raise TypeError(f"eval_params: give the step (or its functrain optimizer) and the state; got "
                        f"{describe(step)[:100]}")
    if optimizer.eval_params is None:
        return state.params
    return optimizer.eval_params(state.params, state.opt_state)


def _adapter(obj: Any, num_steps: Any) -> Optimizer | None:
    """check_optimizer's translation of torch.optim objects (registered with functrain.core.optimizer)."""
    if isinstance(obj, (L.LRScheduler, L.ReduceLROnPlateau)):
        return from_torch(obj.optimizer, scheduler=obj, num_steps=num_steps)
    if isinstance(obj, (tuple, list)):
        torch_opt, scheduler = obj
        return from_torch(torch_opt, scheduler=scheduler, num_steps=num_steps)
    if isinstance(obj, torch.optim.Optimizer):
        return from_torch(obj, num_steps=num_steps)
    return None


register_adapter(_adapter)
