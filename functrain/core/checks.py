"""Host-side checks of a step's inputs: params, batch, loss, and a state against the step it is given to.

All of them read metadata only (types, dtypes, shapes, dict keys): no device
sync, no tree flattening of the state. They run on every call of a step, eager
or compiled (:meth:`functrain.Step.host_call`), so each error is raised before
anything runs, names the bad value and says what was expected.

Example::

    >>> import torch, functrain as ft
    >>> from functrain.core.checks import check_inputs
    >>> step = ft.train_step(lambda p, b, x: (p["w"] * x).sum(), ft.optim.sgd(0.1))
    >>> check_inputs(step.init({"w": torch.ones(2)}), (torch.ones(2),))
"""
from __future__ import annotations

from typing import Any, NamedTuple

import optree
import torch

from . import tree as T
from .validate import BadValue, path_str
from .state import TrainState

__all__ = ["check_inputs", "check_state", "check_params", "check_batch", "check_loss"]

_MISSING = object()


def check_loss(loss: Any) -> None:
    """``loss`` is a floating-point scalar tensor."""
    if not torch.is_tensor(loss):
        raise TypeError(f"loss_fn must return a scalar tensor loss (or (loss, aux)); got {type(loss).__name__}")
    if loss.dim() != 0:
        raise ValueError(f"loss_fn must return a scalar loss (shape ()); got shape {tuple(loss.shape)}. "
                         f"Reduce it, e.g. with .mean() or .sum() (with aux['num_items'])")
    if not loss.is_floating_point():
        raise TypeError(f"loss_fn must return a floating-point loss; got dtype {loss.dtype}")


def check_params(params: Any) -> None:
    """``params`` is a non-empty pytree of floating-point tensors."""
    leaves = optree.tree_leaves(params)
    if not leaves:
        raise ValueError("params is empty: there is nothing to train")
    for path, leaf in zip(optree.tree_paths(params), leaves):
        name = path_str(path)
        if not torch.is_tensor(leaf):
            raise TypeError(f"params must be a pytree of floating-point tensors; {name!r} is {type(leaf).__name__}")
        if not leaf.is_floating_point():
            raise TypeError(f"params must be floating-point tensors; {name!r} has dtype {leaf.dtype}. "
                            f"Move integer tensors to buffers")


def check_batch(batch: Any) -> None:
    """``batch`` is a pytree of tensors (and Python numbers)."""
    leaves = optree.tree_leaves(batch)
    if all(map(torch.is_tensor, leaves)):  # the common case, without a Python loop
        return
    for leaf in leaves:
        if not torch.is_tensor(leaf) and not isinstance(leaf, (int, float, bool)):
            bad = [(path_str(p), type(x).__name__) for p, x in zip(optree.tree_paths(batch), leaves)
                   if not torch.is_tensor(x) and not isinstance(x, (int, float, bool))]
            raise TypeError(f"the batch must be a pytree (tuple/list/dict) of tensors; leaf {bad[0][0]!r} is "
                            f"{bad[0][1]}. Convert it to a tensor (ft.run converts numpy arrays)")


def _kind(value: Any) -> str:
    if torch.is_tensor(value):
        return f"a {value.dtype} tensor of shape {tuple(value.shape)}"
    return type(value).__name__


def rng_problem(rng: Any) -> str:
    """The message for a malformed ``state.rng`` (shared with :func:`functrain.core.rng.with_rng`)."""
    return (f"state.rng must be None or {{'key': int64 CPU tensor [seed, counter]}} (from step.init(..., "
            f"seed=s)); got {_kind(rng) if not isinstance(rng, dict) else {k: _kind(v) for k, v in rng.items()}}")


def rng_ok(rng: Any) -> bool:
    """``rng`` is ``{'key': int64 CPU tensor of shape (2,)}`` (what :func:`functrain.core.rng.rng_init` makes)."""
    key = rng.get("key") if type(rng) is dict and len(rng) == 1 else None
    return torch.is_tensor(key) and key.dtype is torch.int64 and key.shape == (2,) and key.is_cpu


def _check_kind(state: Any) -> torch.Tensor:
    """A TrainState that still owns its storage; returns its ``step`` tensor."""
    if not isinstance(state, TrainState):
        raise TypeError(f"the step takes a functrain TrainState (from step.init); got {type(state).__name__}")
    step = state.step
    if not torch.is_tensor(step):
        raise BadValue(f"the state does not match this step: state.step must be an int64 scalar tensor (the "
                       f"count of steps called); got {_kind(step)}")
    if step.numel() == 0:
        raise RuntimeError("this TrainState was donated to an earlier compiled step (donate=True) and its "
                           "buffers now belong to the state that step returned; use that one")
    return step


def check_inputs(state: Any, batch: Any) -> None:
    """The checks that need no step: a :class:`TrainState` that was not donated, a batch of
    tensors. (A step also runs :func:`check_state`.)"""
    _check_kind(state)
    check_batch(batch)


class Expected(NamedTuple):
    """What a step expects of a state's metadata (found once per step; see :func:`check_state`)."""

    opt_type: type | None           # None: could not be determined, not checked
    slots: dict                     # slot name -> type of the slot
    unknown: frozenset              # names of transforms whose slot could not be determined

    @classmethod
    def of(cls, state: TrainState) -> "Expected":
        """What a state the step made itself (``Step.init``) has."""
        return cls(type(state.opt_state), {k: type(v) for k, v in state.slots.items()}, frozenset())


def check_state(step: Any, state: Any, *, rng: bool = True) -> None:
    """Raise unless ``state`` matches ``step`` (a :class:`functrain.Step`); see :meth:`functrain.Step.check_state`.

    The common case, a state the step made, costs a handful of attribute reads
    and type comparisons; only a mismatch (or the first call, when the step's
    expectation is not known yet) takes the slow path that builds the message.
    ``rng=False`` leaves the form of ``state.rng`` to :func:`functrain.core.rng.with_rng`,
    which checks it as it reads the key (the call path of a step).
    """
    if not isinstance(state, TrainState):
        return _check_state_slowly(step, state)
    count, expected, slots = state.step, step._expected, state.slots
    # (a donated state's step has shape (0,): dim() != 0 sends it to the slow path, which says so)
    if (expected is None or not isinstance(count, torch.Tensor) or count.dtype is not torch.int64 or count.dim() != 0
            or type(slots) is not dict
            or (expected.opt_type is not None and type(state.opt_state) is not expected.opt_type)
            or (rng and state.rng is not None and not rng_ok(state.rng))
            or (not expected.unknown and len(slots) != len(expected.slots))):
        return _check_state_slowly(step, state)
    for name, kind in expected.slots.items():
        if type(slots.get(name, _MISSING)) is not kind:
            return _check_state_slowly(step, state)
    return None


def _check_state_slowly(step: Any, state: Any) -> None:
    _check_kind(state)
    problems = []
    count, slots = state.step, state.slots
    if count.dtype is not torch.int64 or count.dim() != 0:
        problems.append(f"state.step must be an int64 scalar tensor (the count of steps called); got "
                        f"{_kind(count)}")
    if state.rng is not None and not rng_ok(state.rng):
        problems.append(rng_problem(state.rng))
    if type(slots) is not dict:
        problems.append(f"state.slots must be a dict {{transform name: slot}}; got {_kind(slots)}")
        raise BadValue("the state does not match this step: " + "; ".join(problems))
    if step._expected is None:
        step._expected = find_expected(step, state)
    expected = step._expected
    if expected.opt_type is not None and type(state.opt_state) is not expected.opt_type:
        problems.append(f"state.opt_state is {_kind(state.opt_state)} but this step's optimizer keeps "
                        f"{expected.opt_type.__name__}")
    by_name = {t.name: t for t in step.transforms}
    before = len(problems)
    for name in slots:
        if name in expected.slots or name in expected.unknown:
            continue
        if name in by_name:
            problems.append(f"state.slots has {name!r} but this step's {by_name[name]!r} keeps no state")
        else:
            problems.append(f"state.slots has {name!r} but this step has no {name!r} transform")
    for name, kind in expected.slots.items():
        if name not in slots:
            problems.append(f"state.slots lacks {name!r}: this step's {by_name[name]!r} keeps "
                            f"{kind.__name__} there")
        elif type(slots[name]) is not kind:
            problems.append(f"state.slots[{name!r}] is {_kind(slots[name])} but this step's "
                            f"{by_name[name]!r} keeps {kind.__name__}")
    if len(problems) > before:
        problems[-1] += (f"; expected slots {sorted(expected.slots)}, the state has {sorted(slots)} (a state "
                         f"comes from step.init, or a checkpoint, of a step with the same transforms)")
    if problems:
        raise BadValue(f"the state does not match this step: {'; '.join(problems)}")


def find_expected(step: Any, state: TrainState) -> Expected:
    """What ``step.init`` makes for params shaped as ``state.params``: run on meta tensors (no memory,
    no values); an ``init`` that needs values runs once on the real ones."""
    def meta(x: Any) -> Any:
        return torch.empty_like(x, device="meta") if torch.is_tensor(x) else x

    params, buffers = T.tree_map(meta, state.params), T.tree_map(meta, state.buffers)
    opt_type: type | None = None
    try:
        opt_type = type(step.optimizer.init(params))
    except Exception:  # noqa: BLE001 - an optimizer that cannot init on meta tensors: its type is not checked
        pass
    slots, unknown = {}, set()
    for t in step.transforms:
        try:
            slot = t.init(params, buffers)
        except Exception:  # noqa: BLE001 - an init that reads values: run it on the real tensors, once
            try:
                slot = t.init(state.params, state.buffers)
            except Exception:  # noqa: BLE001 - not checkable: accept whatever the state holds there
                unknown.add(t.name)
                continue
        if slot is not None:
            slots[t.name] = type(slot)
    return Expected(opt_type, slots, frozenset(unknown))
