"""The functional optimizer interface and the helpers the optimizers share.

An optimizer is a pure ``(init, update)`` pair over pytrees. ``update`` returns
the *new params* (not Optax-style updates) so that its arithmetic can follow
``torch.optim`` operation for operation, and it never writes into its inputs,
so a whole training step can be traced by ``torch.compile(fullgraph=True)``.
"""
from __future__ import annotations

from functools import partial
from typing import Any, Callable, NamedTuple

import optree
import torch

from ..core import validate as _validate
# describe / is_real / leaf_path are re-exported for the optimizers (one copy, in _validate).
from ..core.validate import describe, is_real  # noqa: F401
from ..core.validate import path_str as leaf_path  # noqa: F401
from ..core.hyper import make as make_hyper, values as hyper_values  # noqa: F401
# the one-path interface the optimizers' updates are written against (eager shortcuts inside)
from ..core.eager import (TreespecCache, double, host_number, lerp, per_step, select, sub_scaled,  # noqa: F401
                          sub_scaled_ratio)

__all__ = ["Optimizer", "Schedule"]


class Optimizer(NamedTuple):
    """A functional optimizer: three pure functions over pytrees, and two declared fields.

    Build one with :func:`~functrain.optim.sgd`, :func:`~functrain.optim.adamw`, ... or
    :func:`~functrain.optim.from_optax_style`; the constructor takes the fields below.

    Attributes:
        init: ``init(params) -> opt_state``: a pytree (a ``NamedTuple`` of tensors and trees
            of tensors) whose ``count`` field is an int64 scalar tensor on the params' device
            holding the number of updates already taken (0 at first).
        update: ``update(grads, opt_state, params) -> (new_params, new_opt_state)``: one step;
            ``grads`` has the structure of ``params``. Inputs are never modified.
        learning_rate: ``learning_rate(opt_state)``: the learning rate the *next* update will use
            (a float for a constant lr, a float64 scalar tensor for a schedule).
        per_param: (default ``False``) whether ``update`` treats parameters by name
            (``weight_decay_mask`` / ``lr_multipliers`` groups). A sharded data-parallel step
            updates flat per-dtype shards, which have no names, and refuses such an optimizer.
        schedule: (default ``None``) the lr it was built with, a float or a schedule
            ``callable(count) -> lr``, so that :func:`functrain.optim.schedules.check_covers` can
            refuse a schedule that ends before the run does (``None``: unknown, nothing is checked).
        eval_params: (default ``None``) ``eval_params(params, opt_state) -> params`` for an optimizer
            whose evaluation weights are not the trained ones (schedule-free AdamW's ``x``);
            :func:`functrain.optim.eval_params` reads it (``None``: the params themselves).
        hyper: (default ``None``) the constructor's hyper-parameters, ``{name: number}`` (a schedule's constants
            nest under ``"lr"``): what ``init`` puts in the state's ``hyper`` field, where ``update`` reads them
            (:mod:`functrain.core.hyper`); not part of the compiled graph's structure (``None``: none as data).

    Example::

        >>> import torch
        >>> from functrain.optim import sgd
        >>> opt = sgd(lr=0.1)
        >>> params = {"w": torch.ones(2)}
        >>> state = opt.init(params)
        >>> params, state = opt.update({"w": torch.ones(2)}, state, params)
        >>> params["w"], int(state.count), opt.learning_rate(state)
        (tensor([0.9000, 0.9000]), 1, 0.1)
    """

    GRAPH_DATA = ("schedule",)  # the lr it was built with is data in the state (functrain.compiler.prekey)

    init: Callable[[Any], Any]
    update: Callable[[Any, Any, Any], tuple]
    learning_rate: Callable[[Any], Any]
    per_param: bool = False
    schedule: Any = None
    eval_params: Callable[[Any, Any], Any] | None = None
    hyper: dict | None = None


# ----------------------------------------------------------------- validation
# The generic checks live in functrain/core/validate.py (they raise BadValue, both a
# TypeError and a ValueError); these wrappers keep the optimizers' wording.


def check_real(
    name: str,
    value: Any,
    *,
    lo: float | None = None,
    hi: float | None = None,
    hi_open: bool = False,
    what: str | None = None,
) -> float:
    """Return ``float(value)`` or raise :class:`~functrain.core.validate.BadValue` (a TypeError
    and a ValueError) naming ``name``, what is allowed and the value given.

    ``what`` describes the allowed values (defaults to a description of the range).

    Example::

        >>> from functrain.optim.base import check_real
        >>> check_real("eps", 1e-8, lo=0.0)
        1e-08
    """
    if what is None:
        if lo is not None and hi is not None:
            what = f"a float in [{lo:g}, {hi:g}{')' if hi_open else ']'}"
        elif lo is not None:
            what = f"a float >= {lo:g}"
        else:
            what = "a finite float"
    return _validate.check_real(name, value, lo=lo, hi=hi, hi_open=hi_open, what=what)


def check_steps(name: str, value: Any, *, minimum: int = 0) -> int:
    """Return ``int(value)`` for an integer (not a bool) >= ``minimum``, else BadValue.

    Example::

        >>> from functrain.optim.base import check_steps
        >>> check_steps("warmup_steps", 10)
        10
    """
    return _validate.check_int(name, value, minimum=minimum)


def check_lr(lr: Any) -> float | Callable[[Any], Any]:
    """A learning rate is a finite float >= 0 or a schedule ``callable(count) -> lr``."""
    what = "a float >= 0 or a schedule callable(count) -> lr"
    if callable(lr) and not isinstance(lr, torch.Tensor):
        return lr
    return check_real("lr", lr, lo=0.0, what=what)


def check_betas(betas: Any) -> tuple[float, float]:
    """Two floats, each in [0, 1)."""
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise TypeError(f"betas must be a pair (beta1, beta2) of floats in [0, 1); got {describe(betas)}")
    return tuple(check_real(f"betas[{i}]", b, lo=0.0, hi=1.0, hi_open=True) for i, b in enumerate(betas))


# ----------------------------------------------------------------- pytrees


def flatten_params(params: Any) -> tuple[list[torch.Tensor], Any]:
    """Flatten ``params`` at ``init``, checking every leaf is a floating-point tensor."""
    paths, leaves, spec = optree.tree_flatten_with_path(params)
    for path, leaf in zip(paths, leaves):
        if not isinstance(leaf, torch.Tensor):
            raise TypeError(
                f"params leaf {leaf_path(path)!r} must be a floating-point torch.Tensor; got {type(leaf).__name__}"
            )
        if not leaf.is_floating_point():
            raise TypeError(
                f"params leaf {leaf_path(path)!r} has dtype {leaf.dtype}; optimizers need floating-point "
                "params (keep integer buffers out of the params tree)"
            )
    return leaves, spec


def init_count(leaves: list[torch.Tensor]) -> torch.Tensor:
    """The int64 step counter (0), on the device of the first param."""
    device = leaves[0].device if leaves else None
    return torch.zeros((), dtype=torch.int64, device=device)


def flatten_update(grads: Any, params: Any, *trees: Any,
                   flatten: Callable = optree.tree_flatten) -> tuple[Callable, list, list, list[list]]:
    """Flatten ``params`` (with ``flatten``: an optimizer passes its :class:`functrain.core.eager.TreespecCache`)
    and bring ``grads`` and the state ``trees`` to its leaf order.

    0-dim leaves are viewed as shape ``(1,)``: a float64 0-dim scalar tensor would
    otherwise promote a 0-dim float32 leaf to float64 in ``_foreach_*(leaves, scalar)``
    (dimensioned leaves keep their dtype). Returns ``unflatten(leaves) -> tree`` that
    undoes both the flattening and those views.
    """
    p, spec = flatten(params)
    is_0d = [x.dim() == 0 for x in p]
    if not any(is_0d):
        return partial(optree.tree_unflatten, spec), p, spec.flatten_up_to(grads), [spec.flatten_up_to(t) for t in trees]

    def lift(leaves: list) -> list:
        return [x.reshape(1) if s else x for x, s in zip(leaves, is_0d)]

    def unflatten(leaves: list) -> Any:
        return optree.tree_unflatten(spec, [x.reshape(()) if s else x for x, s in zip(leaves, is_0d)])

    return unflatten, lift(p), lift(spec.flatten_up_to(grads)), [lift(spec.flatten_up_to(t)) for t in trees]


# ----------------------------------------------------------------- scalars


def count_f64(count: Any) -> torch.Tensor:
    """``count`` as a float64 tensor (on its device when it is a tensor; a Python int made one)."""
    if isinstance(count, torch.Tensor):
        return count.to(torch.float64)
    return torch.tensor(count, dtype=torch.float64)


class Schedule:
    """A learning-rate schedule whose constants are data: ``schedule(count)`` uses the ones it was built with,
    ``schedule.at(count, constants)`` the ones an optimizer's state holds (``ft.get_hyper(state)["lr"][name]``), so a
    compiled step reads them as inputs and one graph serves every peak, warm-up and horizon.

    Attributes:
        name: the kind (``"warmup_cosine"``, ...): the state holds ``{name: constants}``, so a schedule of another
            kind is refused by :func:`functrain.set_hyper` instead of being read with the wrong formula.
        constants: ``{name: number}`` (a tree for :func:`join` and :func:`scale`) it was built with.
        total_steps: the horizon (see the module docstring), ``None`` for a schedule that never ends.

    Example::

        >>> import torch
        >>> from functrain.optim.schedules import warmup_cosine
        >>> s = warmup_cosine(1.0, warmup_steps=2, total_steps=6)
        >>> s.name, s.constants["total_steps"], round(float(s(4)), 6)
        ('warmup_cosine', 6, 0.5)
        >>> c = {**s.constants, "total_steps": torch.tensor(10.0, dtype=torch.float64)}
        >>> round(float(s.at(torch.tensor(6), c)), 6)   # count 6 of a 10-step run
        0.5
    """

    GRAPH_DATA = ("constants", "total_steps")  # data in the state, not structure (functrain.compiler.prekey)

    def __init__(self, name: str, constants: dict, formula: Callable[[torch.Tensor, dict], torch.Tensor],
                 total_steps: int | None):
        self.name, self.constants, self._formula, self.total_steps = name, constants, formula, total_steps

    def __call__(self, count: Any) -> torch.Tensor:
        return self.at(count, self.constants)

    def at(self, count: Any, constants: dict) -> torch.Tensor:
        """The lr at ``count`` with ``constants`` (numbers, or the state's 0-dim float64 tensors)."""
        return self._formula(count_f64(count), constants)

    def hyper_values(self) -> dict:
        """``{name: constants}``: what an optimizer's state holds for this schedule (its ``hyper["lr"]``)."""
        return {self.name: self.constants}

    def __repr__(self) -> str:
        return f"{self.name}({', '.join(f'{k}={v!r}' for k, v in self.constants.items())})"




def decay_hyper(weight_decay: float) -> dict:
    """What an optimizer built with ``weight_decay`` keeps of it in its state's ``hyper``: ``{"weight_decay": the
    number}``, or nothing for 0. A decay of 0 is the step's structure, as ``momentum=0`` is: no decay term in the
    graph. A decay held as data always decays (``g + wd * p``, exact for 0), and that term changed how inductor
    scheduled a remat step's recomputation (the LM of tests/compiler/test_compiled_remat.py held 55 MB instead of
    26.5 MB with SGD); so a step that may decay is built with a decay > 0, which ``set_hyper`` can then set to any
    value, 0 included."""
    return {"weight_decay": weight_decay} if weight_decay != 0 else {}


def lr_hyper(lr: float | Callable[[Any], Any]) -> dict:
    """What an optimizer built with ``lr`` keeps of it in its state's ``hyper``: ``{"lr": the number}``, ``{"lr":
    {kind: constants}}`` for a :class:`Schedule`, nothing for another callable (its constants stay its own)."""
    if not callable(lr):
        return {"lr": lr}
    if isinstance(lr, Schedule):
        return {"lr": lr.hyper_values()}
    return {}


def lr_value(lr: float | Callable[[Any], Any], count: torch.Tensor, hyper: dict | None = None) -> float | torch.Tensor:
    """The lr for the update taken at ``count``: the number, or the schedule's value at ``count`` as float64;
    with ``hyper`` (a state's values, :func:`functrain.core.hyper.values`) the number or the schedule's
    constants come from there."""
    if not callable(lr):
        return lr if hyper is None else hyper["lr"]
    if isinstance(lr, Schedule) and hyper is not None:
        value = lr.at(count, hyper["lr"][lr.name])
    else:
        value = lr(count)
    if isinstance(value, torch.Tensor):
        return per_step(value.to(dtype=torch.float64, device=count.device))[0]  # a cosine once, not per vector
    return torch.tensor(value, dtype=torch.float64, device=count.device)


def make_learning_rate(lr: float | Callable[[Any], Any], defaults: dict | None = None) -> Callable[[Any], Any]:
    """``learning_rate(opt_state)`` for an optimizer built with ``lr`` (give ``lr`` to the
    :class:`Optimizer` as its ``schedule`` too). With ``defaults`` (the optimizer's hyper-parameters) the lr
    is read from the state's ``hyper`` field (the constructor's when the state has none)."""

    def learning_rate(opt_state: Any) -> float | torch.Tensor:
        if defaults is None:
            return lr_value(lr, opt_state.count)
        return lr_value(lr, opt_state.count, hyper_values(opt_state.hyper, defaults))

    return learning_rate


def lerp_weight(weight: Any, leaves: list[torch.Tensor]) -> Any:
    """A lerp weight for ``lerp(leaves, ...)`` (:func:`functrain.core.eager.lerp`): a number as it is; a tensor (a state's
    hyper-parameter) as one 0-dim weight per leaf in the leaf's dtype, the precision lerp computes in for a number
    (computed leaf by leaf)."""
    if not isinstance(weight, torch.Tensor):
        return weight
    return [weight.to(x.dtype) for x in leaves]


def add_scalar_(xs: list[torch.Tensor], s: Any) -> None:
    """``xs += s`` in place: a number as ``_foreach_add_(xs, s)``; a tensor (a state's hyper-parameter) as one 0-dim
    tensor per leaf in its dtype (Dynamo reads a lone tensor given as ``_foreach_add``'s scalar as a number, a
    constant of the graph with a guard on it: a recompile per value)."""
    if isinstance(s, torch.Tensor):
        torch._foreach_add_(xs, [s.to(x.dtype) for x in xs])
    else:
        torch._foreach_add_(xs, s)


def add_scaled(xs: list[torch.Tensor], ys: list[torch.Tensor], s: Any) -> list[torch.Tensor]:
    """``xs + s * ys``, new tensors: ``_foreach_add(xs, ys, alpha=s)`` for a number (torch.optim's), ``xs + ys * s``
    for a tensor (a state's hyper-parameter; ``alpha=`` takes a number only)."""
    if isinstance(s, torch.Tensor):
        return torch._foreach_add(xs, torch._foreach_mul(ys, s))
    return torch._foreach_add(xs, ys, alpha=s)


def scaled_sq_into(v: list[torch.Tensor], g: list[torch.Tensor], value: Any) -> None:
    """``v += value * g * g`` in place (the second moment): ``addcmul(value=)`` for a number, as torch.optim;
    for a tensor, which ``addcmul`` takes only per leaf, ``v += (g * value) * g`` (torch.optim's tensor path)."""
    if isinstance(value, torch.Tensor):
        torch._foreach_addcmul_(v, torch._foreach_mul(g, value), g, value=1)
    else:
        torch._foreach_addcmul_(v, g, g, value=value)


# -- the paragraphs every optimizer's docstring shares, written once -------------------------------------------
_SHARED_DOCS = {
    "{LR}": """        lr: the learning rate: a finite float >= 0, or a schedule ``callable(count) -> lr``
            (:mod:`functrain.optim.schedules`) of the number of updates already taken.
""",
    "{GROUPS}": """        weight_decay_mask: which leaves get weight decay: ``None`` (default: every leaf), a
            pytree of bools shaped like the params, or a predicate ``callable(name, param) -> bool``
            such as :func:`functrain.optim.masks.no_decay_bias_and_norm` (:mod:`functrain.optim.groups`).
            With ``weight_decay=0`` it has no effect, and a ``UserWarning`` says so.
        lr_multipliers: a factor on the lr per leaf: ``None`` (default: 1.0 everywhere), a pytree
            of floats >= 0 shaped like the params, or ``callable(name, param) -> float``; a leaf's
            lr is ``lr * multiplier``.
""",
    "{RAISES}": """        BadValue: (a ``TypeError`` and a ``ValueError``, from :mod:`functrain.core.validate`) for an
            argument out of range or of the wrong type, naming it and what is allowed; a bad mask or
            multiplier leaf is reported by ``init``, which sees the params.
""",
}


def shared_docs(fn: Callable) -> Callable:
    """``fn`` with the paragraphs every optimizer's docstring shares filled in: a line ``{LR}``, ``{GROUPS}`` or
    ``{RAISES}`` (indented as an argument) stands for the text in ``_SHARED_DOCS``, written once here."""
    doc = fn.__doc__ or ""
    for key, text in _SHARED_DOCS.items():
        doc = doc.replace("        " + key + "\n", text)
    fn.__doc__ = doc
    return fn
