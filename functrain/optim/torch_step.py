"""The escape hatch: any ``torch.optim`` optimizer, run by its own ``step()`` on the state's tensors.

For an optimizer functrain has no port of (``RMSprop``, ``Adagrad``, a package's optimizer,
a subclass), :func:`torch_step` keeps a private twin of it (the same class and param-group
settings, its own ``Parameter`` objects; the user's optimizer, model and scheduler are never
touched) and each update: puts copies of the params and gradients into the twin's params,
copies of the optimizer state (kept in the functrain state, :class:`TorchStepState`) into its
``state``, and the group numbers its ``step()`` changes (schedule-free's ``k``,
``weight_sum``) into its param groups; calls ``step()``; and reads the new params, state and
numbers back. The update is then exactly the optimizer's own, and the whole optimizer state is
in the functrain state: checkpoints and a resume are bit-exact.

What it gives up: it runs Python on the host, so a step with it cannot be compiled
(``ft.compile``, ``torch.compile``: refused when traced) and reads the step count on the host
each update; it copies params, gradients and state once per update; it needs each param whole
and named (refused under ``data_parallel(shard=...)`` and with ``init(flat=True)``); and its
state's layout (which keys each param's state holds, from which update on, and the group numbers) is
learnt at ``init`` by running ``step()`` on copies with zero gradients, ``layout_steps`` times (one by
default). A state that grows later (a key first made at update 5, such as a weight average started
after a warm-up) is carried from the start as a placeholder and handed to ``step()`` from that
update on, bit for bit; a key that appears, goes or comes at another update than the probe saw is
refused by name (the functrain state's structure is fixed at ``init``: checkpoints and a skipped
update's select need it so), naming the ``layout_steps`` that would learn it.
"""
from __future__ import annotations

import copy
from collections import defaultdict
from typing import Any, NamedTuple

import torch

from ..core.eager import tracing
from ..core.flat import is_flat
from ..core.registry import register_checkpoint_type
from .base import Optimizer, describe, host_number, make_learning_rate
from .partition import named_leaves
from .torch_names import match_names, named_params
from .torch_schedules import from_torch_scheduler

__all__ = ["torch_step", "TorchStepState"]


@register_checkpoint_type("functrain.optim.TorchStepState")
class TorchStepState(NamedTuple):
    """State of :func:`torch_step`: the torch optimizer's own state, as tensors.

    Attributes:
        count: the number of updates applied, an int64 scalar tensor.
        state: ``{param name: {torch state key: tensor}}``, the optimizer's ``state[p]`` (a Python
            number in it is kept as a 0-d int64 / float64 tensor).
        groups: per param group, ``{key: 0-d tensor}`` of the group's numbers its ``step()`` may change.

    Example::

        >>> import torch
        >>> from functrain.optim import torch_step
        >>> w = torch.nn.Parameter(torch.ones(2))
        >>> state = torch_step(torch.optim.RMSprop([w], lr=0.1), {"w": w}).init({"w": w.detach()})
        >>> int(state.count), sorted(state.state["w"])
        (0, ['square_avg', 'step'])
    """

    count: torch.Tensor
    state: dict
    groups: tuple


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _as_tensor(value: Any, device: Any) -> torch.Tensor:
    dtype = torch.int64 if isinstance(value, int) else torch.float64
    return torch.tensor(value, dtype=dtype, device=device)


def _twin(torch_opt: torch.optim.Optimizer) -> tuple[torch.optim.Optimizer, list[list[torch.nn.Parameter]]]:
    """A private optimizer of the same class and group settings over placeholder Parameters."""
    twin = object.__new__(type(torch_opt))
    attrs = dict(vars(torch_opt))
    for name in ("step", "_opt_called"):  # an lr scheduler's wrapper of the user's optimizer.step
        attrs.pop(name, None)
    twin.__dict__.update(attrs)
    params = [[torch.nn.Parameter(torch.empty(0, dtype=p.dtype, device=p.device), requires_grad=p.requires_grad)
               for p in g["params"]] for g in torch_opt.param_groups]
    twin.defaults = copy.deepcopy(torch_opt.defaults)
    twin.state = defaultdict(dict)
    twin.param_groups = [{**{k: copy.deepcopy(v) for k, v in g.items() if k != "params"}, "params": ps}
                         for g, ps in zip(torch_opt.param_groups, params)]
    return twin, params


def _present(since: int | None, count: int) -> bool:
    """Whether a state key first made by the update that brought the count to ``since`` is in the optimizer's
    state at ``count`` (``since=None``: from the start)."""
    return since is None or count >= since


class _Hatch:
    def __init__(self, torch_opt: torch.optim.Optimizer, names: Any, tables: list | None, layout_steps: int) -> None:
        self.cls = type(torch_opt).__name__
        self.torch_groups = [list(g["params"]) for g in torch_opt.param_groups]
        self.twin, self.twin_params = _twin(torch_opt)
        self.names, self.tables, self.layout_steps = names, tables, layout_steps
        self.given = [[{k: v for k, v in torch_opt.state.get(p, {}).items()} for p in g] for g in self.torch_groups]
        self.start_groups = [{k: v for k, v in g.items() if k != "params"} for g in self.twin.param_groups]
        # learnt at init: per param {key: "tensor" | "number"} (carried) and {key: None | bool | str} (constants),
        # and for every key the count from which on it is in the state (None: from the start)
        self.layout: dict | None = None
        self._static: dict = {}
        self.since: dict = {}
        self.group_keys: list[dict] = []  # per group {number's key: since}
        self.count0 = 0  # the count at init (the probe's updates are counted from it)
        self.has_eval = callable(getattr(type(torch_opt), "eval", None)) and callable(
            getattr(type(torch_opt), "train", None))

    # -- names and layout ------------------------------------------------------------------------
    def _names(self, params: Any) -> list[list[str | None]]:
        if self.names is None:
            leaf_names, leaves, _ = named_leaves(params)
            self.names = match_names(self.torch_groups, list(zip(leaf_names, leaves)), "the params given to init",
                                     self.cls)
        return self.names

    def _refuse_flat(self, params: Any) -> None:
        if is_flat(params):
            raise ValueError(f"ft.optim.torch_step ({self.cls}.step()) needs each param whole and by name; these "
                             f"params are flat (init(flat=True), or a data_parallel(shard=...) step's shards): drop "
                             f"flat=True, use shard='none'")

    def _load(self, params: Any, grads: Any, states: dict | None, numbers: list[dict] | None) -> dict:
        """Put copies of the params, grads (zeros: ``None``) and per-param states (``{name: {key: value}}``, or
        ``None``: none yet) into the twin, and set (a value) or remove (``None``) its groups' ``numbers``;
        returns ``{name: twin param}``."""
        leaf_names, leaves, spec = named_leaves(params)
        leaf = dict(zip(leaf_names, leaves))
        grad = dict(zip(leaf_names, spec.flatten_up_to(grads))) if grads is not None else None
        used = {}
        self.twin.state = defaultdict(dict)
        for i, (names, twins) in enumerate(zip(self.names, self.twin_params)):
            for name, tp in zip(names, twins):
                if name is None:  # frozen: no gradient, torch skips it
                    tp.grad = None
                    continue
                tp.data = leaf[name].detach().clone()
                tp.grad = torch.zeros_like(tp.data) if grad is None else grad[name].detach().clone()
                if states is not None and states[name]:  # (no key yet: no entry, as before torch's first step)
                    self.twin.state[tp] = {k: v.clone() if isinstance(v, torch.Tensor) else v
                                           for k, v in states[name].items()}
                used[name] = tp
            for key, value in (numbers[i] if numbers is not None else {}).items():
                if value is None:
                    self.twin.param_groups[i].pop(key, None)
                else:
                    self.twin.param_groups[i][key] = value
        return used

    def _twin_state(self, name: str, carried: dict, count: int) -> dict:
        """Param ``name``'s torch state at ``count``: the carried keys made by then, and the constants."""
        since = self.since[name]
        out = {k: v if kind == "tensor" else v.item() for k, kind in self.layout[name].items()
               if _present(since[k], count) for v in (carried[k],)}
        out.update({k: v for k, v in self._static[name].items() if _present(since[k], count)})
        return out

    def _states(self, state: TorchStepState, count: int) -> tuple[dict, list[dict]]:
        """What :meth:`_load` puts into the twin for ``state`` at ``count``: per-param states and group numbers."""
        states = {n: self._twin_state(n, st, count) for n, st in state.state.items()}
        numbers = [{k: state.groups[i][k].item() if _present(since, count) else None for k, since in keys.items()}
                   for i, keys in enumerate(self.group_keys)]
        return states, numbers

    def _unload(self) -> None:
        for twins in self.twin_params:
            for tp in twins:
                tp.data, tp.grad = torch.empty(0, dtype=tp.dtype, device=tp.device), None
        self.twin.state = defaultdict(dict)
        for group, start in zip(self.twin.param_groups, self.start_groups):
            for key in [k for k in group if k != "params"]:
                del group[key]
            group.update({k: copy.deepcopy(v) for k, v in start.items()})

    def _tracked(self, key: str) -> bool:
        """Whether a group number is carried (a translated scheduler sets each update's lr)."""
        return not (key == "lr" and self.tables is not None)

    def init(self, params: Any) -> TorchStepState:
        self._refuse_flat(params)
        names = self._names(params)
        leaf_names, leaves, _ = named_leaves(params)
        missing = [n for g in names for n in g if n is not None and n not in set(leaf_names)]
        if missing:
            raise ValueError(f"{self.cls}'s params {missing[:6]} are not among the params given to init")
        device = leaves[0].device if leaves else None
        given = {n: s for g, row in zip(names, self.given) for n, s in zip(g, row) if n is not None}
        holders = [n for n, s in given.items() if s]
        if holders and len(holders) != len(given):
            empty = next(n for n, s in given.items() if not s)
            raise ValueError(f"{self.cls} has state for param {holders[0]!r} but none for {empty!r}; functrain "
                             f"steps every param together: hand over a fresh optimizer, or one whose params all have "
                             f"state")
        self.count0 = count = self._count(given)
        self.layout, self._static, self.since, tensors = {}, {}, {}, {}
        for name, st in given.items():  # a state handed over (or made by the optimizer's __init__, Adagrad's)
            self._classify(name, st, device, tensors, None)
        # learn the rest of the layout (a state made lazily, and when; the groups' numbers): step() on copies with
        # zero gradients, layout_steps times
        group_since: list[dict] = [{} for _ in self.start_groups]
        try:
            self._load(params, None, {n: self._twin_state(n, tensors[n], count) for n in given}, None)
            before = [set(g) for g in self.twin.param_groups]
            for j in range(1, self.layout_steps + 1):
                self.twin.step()
                for name, tp in self._by_name().items():
                    st = self.twin.state.get(tp, {})
                    gone = [k for k in self.since[name] if k not in st]
                    if gone:
                        raise ValueError(f"{self.cls}.step() removed the state {gone[0]!r} of param {name!r} at its "
                                         f"step {j} on copies (init's probe); ft.optim.torch_step carries a state "
                                         f"whose keys only grow")
                    new = {k: v for k, v in st.items() if k not in self.since[name]}
                    self._classify(name, new, device, tensors, count + j)
                for i, group in enumerate(self.twin.param_groups):
                    for k, v in group.items():
                        if k not in group_since[i] and _number(v) and self._tracked(k):
                            group_since[i][k] = None if k in before[i] else count + j
        finally:
            self._unload()
        self.group_keys, groups = group_since, []
        for start, keys in zip(self.start_groups, group_since):
            # a number there from the start carries its value; one made later a placeholder until then
            groups.append({k: _as_tensor(start[k] if since is None and _number(start.get(k)) else 0, device)
                           for k, since in keys.items()})
        return TorchStepState(count=torch.tensor(count, dtype=torch.int64, device=device), state=tensors,
                              groups=tuple(groups))

    def _classify(self, name: str, st: dict, device: Any, tensors: dict, since: int | None) -> None:
        """Sort keys of param ``name``'s torch state into tensors (carried), numbers (carried as 0-d tensors) and
        constants, each in the state from count ``since`` on (``None``: from the start, its value carried; else a
        zero placeholder until then)."""
        layout, static = self.layout.setdefault(name, {}), self._static.setdefault(name, {})
        out, when = tensors.setdefault(name, {}), self.since.setdefault(name, {})
        for key, value in st.items():
            if isinstance(value, torch.Tensor):
                layout[key] = "tensor"
                out[key] = value.detach().clone() if since is None else torch.zeros_like(value)
            elif _number(value):
                layout[key] = "number"
                out[key] = _as_tensor(value if since is None else type(value)(0), device)
            elif value is None or isinstance(value, (bool, str)):
                static[key] = value
            else:
                raise TypeError(f"{self.cls}'s state of param {name!r} holds {key!r} = {describe(value)[:80]}; "
                                f"ft.optim.torch_step carries tensors and numbers")
            when[key] = since

    def _count(self, given: dict) -> int:
        steps = {int(s["step"]) for s in given.values() if _number(s.get("step")) or (
            isinstance(s.get("step"), torch.Tensor) and s["step"].numel() == 1)}
        if len(steps) > 1:
            raise ValueError(f"{self.cls}'s params have stepped different numbers of times ({sorted(steps)})")
        if self.tables is not None:
            return self.tables[0].start
        return steps.pop() if steps else 0

    def _by_name(self) -> dict:
        return {n: tp for names, twins in zip(self.names, self.twin_params) for n, tp in zip(names, twins)
                if n is not None}

    # -- the update ------------------------------------------------------------------------------
    def update(self, grads: Any, state: TorchStepState, params: Any) -> tuple[Any, TorchStepState]:
        if tracing():
            raise RuntimeError(f"ft.optim.torch_step runs {self.cls}.step() in Python on the host, which a compiled "
                               f"graph cannot hold: run this step uncompiled (no ft.compile / torch.compile; the "
                               f"Trainer: TrainConfig(compile=False)), or use a functional port (ft.optim.from_torch "
                               f"translates SGD, Adam, AdamW and AdamWScheduleFree)")
        self._refuse_flat(params)
        if self.layout is None:
            raise RuntimeError(f"ft.optim.torch_step ({self.cls}): call init(params) (step.init) before update, in "
                               f"this process")
        count = int(host_number(state.count))
        try:
            used = self._load(params, grads, *self._states(state, count))
            if self.tables is not None:
                for group, table in zip(self.twin.param_groups, self.tables):
                    group["lr"] = float(table(count))
            self.twin.step()
            new_params = {n: tp.data for n, tp in used.items()}
            new_state = {n: self._read(n, self.twin.state.get(tp, {}), state.state[n], count + 1)
                         for n, tp in used.items()}
            groups = tuple({k: self._group_number(i, k, v, count + 1) for k, v in g.items()}
                           for i, g in enumerate(state.groups))
            self._no_new_numbers(count + 1)
        finally:
            self._unload()
        leaf_names, leaves, spec = named_leaves(params)
        out = [new_params.get(n, x) for n, x in zip(leaf_names, leaves)]
        return spec.unflatten(out), TorchStepState(count=state.count + 1, state=new_state, groups=groups)

    def _unlearnt(self, what: str, count: int) -> ValueError:
        """The refusal of a state that changed its keys where init's probe did not see it (see the docstring)."""
        steps = count - self.count0
        if steps > self.layout_steps:
            how = (f"init learnt the keys from {self.layout_steps} step(s) on copies; pass ft.optim.torch_step("
                   f"optimizer, layout_steps={steps}) so that init's probe reaches this update")
        else:
            how = (f"init's probe (step() on copies with zero gradients) made it at another update, so its keys "
                   f"depend on the gradients")
        return ValueError(f"{self.cls}.step() {what} at update {count}: {how}. ft.optim.torch_step carries a state "
                          f"whose keys are fixed at init (a checkpoint and a skipped update keep one structure), so "
                          f"it refuses rather than drop the change")

    def _read(self, name: str, st: dict, old: dict, count: int) -> dict:
        since = self.since[name]
        added = [k for k in st if k not in since]
        if added:
            raise self._unlearnt(f"added the state {added[0]!r} to param {name!r}", count)
        for key, when in since.items():
            if (key in st) != _present(when, count):
                if key in st:
                    raise self._unlearnt(f"made the state {key!r} of param {name!r}", count)
                raise ValueError(f"{self.cls}.step() left param {name!r} without state {key!r} at update {count} "
                                 f"(init's probe had it{'' if when is None else f' from update {when}'} on); "
                                 f"ft.optim.torch_step carries a state whose keys only grow")
        out = {}
        for key, kind in self.layout[name].items():
            if key not in st:  # (made by a later update: its placeholder until then)
                out[key] = old[key]
                continue
            value = st[key]
            if kind == "tensor":
                if not isinstance(value, torch.Tensor) or value.shape != old[key].shape or value.dtype != old[key].dtype:
                    raise ValueError(f"{self.cls}.step() changed the state {key!r} of param {name!r} to "
                                     f"{describe(value)[:80]}; expected a {old[key].dtype} tensor of shape "
                                     f"{tuple(old[key].shape)}")
                out[key] = value
            else:
                out[key] = _as_tensor(value.item() if isinstance(value, torch.Tensor) else value, old[key].device)
        return out

    def _group_number(self, i: int, key: str, old: torch.Tensor, count: int) -> torch.Tensor:
        group = self.twin.param_groups[i]
        if not _present(self.group_keys[i][key], count):
            if key in group:
                raise self._unlearnt(f"made param group {i}'s number {key!r}", count)
            return old  # (a placeholder until the update that makes it)
        value = group.get(key)
        if not _number(value):
            raise TypeError(f"{self.cls}.step() left param group {i}'s {key!r} = {describe(value)[:80]}, no longer a "
                            f"number")
        return _as_tensor(value, old.device)

    def _no_new_numbers(self, count: int) -> None:
        for i, (group, keys) in enumerate(zip(self.twin.param_groups, self.group_keys)):
            new = [k for k, v in group.items() if k not in keys and _number(v) and self._tracked(k)]
            if new:
                raise self._unlearnt(f"added the number {new[0]!r} to param group {i}", count)

    def eval_params(self, params: Any, state: TorchStepState) -> Any:
        """The optimizer's own ``eval()`` (schedule-free's x) on copies of the params and state."""
        if self.layout is None:
            raise RuntimeError(f"ft.optim.torch_step ({self.cls}): call init(params) first")
        try:
            used = self._load(params, None, *self._states(state, int(host_number(state.count))))
            for group in self.twin.param_groups:
                group["train_mode"] = True
            self.twin.eval()
            x = {n: tp.data for n, tp in used.items()}
        finally:
            self._unload()
        leaf_names, leaves, spec = named_leaves(params)
        return spec.unflatten([x.get(n, p) for n, p in zip(leaf_names, leaves)])


def torch_step(torch_optimizer: torch.optim.Optimizer, params: Any = None, *, scheduler: Any = None,
               num_steps: int | None = None, layout_steps: int = 1) -> Optimizer:
    """Any ``torch.optim`` optimizer as a functrain optimizer that runs its own ``step()`` (eagerly).

    The escape hatch for optimizers without a functional port (:func:`functrain.optim.from_torch`
    uses it for them): each update calls ``step()`` of a private twin of ``torch_optimizer`` on
    copies of the params, gradients and optimizer state, which lives in the functrain state
    (:class:`TorchStepState`), so the update is the optimizer's own and a resume bit-exact.
    Not compilable (refused when traced), not under ``data_parallel(shard=...)`` or
    ``init(flat=True)``; the module docstring lists the costs. A schedule-free optimizer's
    ``eval()`` weights: :func:`functrain.optim.eval_params`.

    Args:
        torch_optimizer: a ``torch.optim.Optimizer`` instance (any class with ``step()``).
        params: the names of its params, as for :func:`functrain.optim.from_torch` (``None``: the
            names torch kept, else matched at ``init`` with the model's own params).
        scheduler: its lr scheduler, or ``None``: each group's lr per update is set from a table
            (:func:`functrain.optim.from_torch_scheduler`) before ``step()``.
        num_steps: the run's number of updates: the horizon of a scheduler without an end.
        layout_steps: how many ``step()`` calls ``init`` runs on copies (zero gradients) to learn the
            optimizer's state: which keys each param's state holds and from which update on (default 1: a
            state made at the first update). An optimizer whose state grows later (a key first made at
            update 5) needs ``layout_steps=5``; short of that, the update that makes it is refused by name.

    Returns:
        An :class:`~functrain.optim.Optimizer` (``per_param=True``) whose state is :class:`TorchStepState`.

    Raises:
        TypeError: not an optimizer instance, bad ``params``, or state that is not tensors and numbers.
        ValueError: a param no name is found for, a scheduler of another optimizer, a state that
            cannot be handed over, or (at an update) a state whose keys changed where ``init`` did not
            learn it (the message names the key, the update and the ``layout_steps`` that learns it).

    Example::

        >>> import torch
        >>> from functrain.optim import torch_step
        >>> w = torch.nn.Parameter(torch.ones(2))
        >>> opt = torch_step(torch.optim.Adagrad([w], lr=0.5), {"w": w})
        >>> params = {"w": w.detach()}
        >>> state = opt.init(params)
        >>> params, state = opt.update({"w": torch.ones(2)}, state, params)
        >>> params["w"], w                 # Adagrad's first step; the model's own Parameter is untouched
        (tensor([0.5000, 0.5000]), Parameter containing:
        tensor([1., 1.], requires_grad=True))
    """
    if not isinstance(torch_optimizer, torch.optim.Optimizer):
        raise TypeError(f"torch_step: torch_optimizer must be a torch.optim.Optimizer instance; got "
                        f"{describe(torch_optimizer)[:100]}")
    if scheduler is not None and scheduler.optimizer is not torch_optimizer:
        raise ValueError(f"torch_step: the {type(scheduler).__name__} given schedules another optimizer")
    for i, g in enumerate(torch_optimizer.param_groups):
        if isinstance(g.get("lr"), torch.Tensor) and scheduler is not None:
            raise TypeError(f"torch_step: param group {i} has a tensor lr; a translated scheduler sets float lrs")
    if isinstance(layout_steps, bool) or not isinstance(layout_steps, int) or layout_steps < 1:
        raise ValueError(f"torch_step: layout_steps must be an int >= 1 (the step() calls init runs on copies to "
                         f"learn the optimizer's state); got {layout_steps!r}")
    tables = None if scheduler is None else from_torch_scheduler(scheduler, num_steps=num_steps)
    torch_groups = [list(g["params"]) for g in torch_optimizer.param_groups]
    named = named_params(params, "torch_step")
    names = None
    if named is not None:
        names = match_names(torch_groups, named, "the named params given", type(torch_optimizer).__name__)
    elif all("param_names" in g for g in torch_optimizer.param_groups):
        names = [[n if p.requires_grad else None for n, p in zip(g["param_names"], g["params"])]
                 for g in torch_optimizer.param_groups]
    hatch = _Hatch(torch_optimizer, names, tables, layout_steps)
    lr0 = tables[0] if tables is not None else torch_optimizer.param_groups[0].get("lr", float("nan"))
    # under ft.compile(fullgraph=False) / torch.compile, a graph break: the update runs eagerly between graphs
    return Optimizer(init=hatch.init, update=torch.compiler.disable(hatch.update), learning_rate=make_learning_rate(lr0), per_param=True,
                     schedule=tables[0] if tables is not None else None,
                     eval_params=hatch.eval_params if hatch.has_eval else None)
