"""Law checkers for functrain steps: bitwise or allclose state comparison, purity, compiled equals eager, order
independence of transforms. Re-exported by :mod:`functrain.testing`."""
from __future__ import annotations

import itertools
from typing import Any, Callable, Sequence

import optree
import torch

from ..core import tree as T
from ..core.validate import path_str
from ..core.flat import unflat
from ..compiler.api import CompiledStep
from ..compiler.api import compile as ft_compile
from ..core.step import Step

__all__ = ["assert_same_state", "assert_pure", "assert_compiled_equals_eager", "assert_order_independent",
           "run_steps", "clone_tree"]


def clone_tree(tree: Any) -> Any:
    """A copy of ``tree`` whose tensor leaves are fresh, detached clones (other leaves shared).

    Args:
        tree: any pytree.

    Returns:
        The copy.

    Example:
        >>> import torch, functrain.testing as ftt
        >>> tree = {"w": torch.ones(2), "n": 3}
        >>> copy = ftt.clone_tree(tree)
        >>> copy["w"] is tree["w"], bool(torch.equal(copy["w"], tree["w"])), copy["n"]
        (False, True, 3)
    """
    return optree.tree_map(lambda x: x.detach().clone() if torch.is_tensor(x) else x, tree)


def _batch_at(batch: Any, i: int) -> Any:
    return batch(i) if callable(batch) else batch


def run_steps(step: Callable, state: Any, batch: Any, steps: int = 1) -> tuple[Any, list]:
    """Run ``steps`` steps of ``step(state, batch) -> (state, metrics)`` from ``state``.

    Args:
        step, state: the step and the initial state.
        batch: one batch, or ``callable(i) -> batch`` for step ``i``.
        steps: how many steps (default 1).

    Returns:
        ``(final state, [metrics of each step])``.

    Example:
        >>> import torch, functrain as ft, functrain.testing as ftt
        >>> step = ft.train_step(lambda p, b, x: (p["w"] * x).sum(), ft.optim.sgd(0.5))
        >>> state, history = ftt.run_steps(step, step.init({"w": torch.zeros(1)}), torch.ones(1), 3)
        >>> state.params["w"], len(history)
        (tensor([-1.5000]), 3)
    """
    history = []
    for i in range(steps):
        state, metrics = step(state, _batch_at(batch, i))
        history.append(metrics)
    return state, history


# -- checkers -----------------------------------------------------------------------------------
def _describe_diff(path: str, a: Any, b: Any, rtol: float, atol: float) -> str | None:
    """Why leaf ``a`` differs from reference ``b`` (``None`` when they match)."""
    if not (torch.is_tensor(a) and torch.is_tensor(b)):
        return None if type(a) is type(b) and a == b else f"{path}: {a!r} != {b!r}"
    if a.shape != b.shape or a.dtype != b.dtype:
        return f"{path}: {tuple(a.shape)} {a.dtype} vs {tuple(b.shape)} {b.dtype}"
    exact = (rtol == 0 and atol == 0) or not a.is_floating_point()
    if exact:
        bad = T._bits(a) != T._bits(b) if a.is_floating_point() else a != b  # -0.0 vs 0.0 and NaN payloads count
    else:
        bad = ~torch.isclose(a, b, rtol=rtol, atol=atol, equal_nan=True)
    if not bad.any():
        return None
    idx = tuple(int(i) for i in bad.nonzero()[0])
    diff = (a.double() - b.double()).abs().nan_to_num(float("inf")) if a.is_floating_point() else bad
    tol = "bitwise" if exact else f"atol={atol:g} + rtol={rtol:g} * |ref|"
    return (f"{path}: {int(bad.sum())}/{a.numel()} elements differ ({tol}); max |diff| = "
            f"{float(diff.max()):.4g}; first at {idx}: {a[idx].item()!r} vs reference {b[idx].item()!r}")


def assert_same_state(actual: Any, expected: Any, rtol: float = 0.0, atol: float = 0.0, *, what: str = "state") -> None:
    """Assert two pytrees (states, metrics, anything) match, leaf by leaf; flat params
    (:func:`functrain.flat`) by name, so a flat state matches the plain state it stands for.

    Args:
        actual, expected: the pytree under test and the reference.
        rtol, atol: the tolerances (default 0.0: bitwise equal, ``-0.0`` vs ``0.0`` and NaN payloads
            count; else ``allclose`` with NaNs equal); integer and bool leaves always exactly.
        what: the name of the compared thing in the message (default ``"state"``).

    Returns:
        ``None``.

    Raises:
        AssertionError: the structures differ, or leaves differ: the message names the first five,
            how many elements differ, the largest difference and where.

    Example:
        >>> import torch, functrain.testing as ftt
        >>> ftt.assert_same_state({"w": torch.tensor([1.0])}, {"w": torch.tensor([1.0 + 1e-7])}, atol=1e-6)
        >>> ftt.assert_same_state({"w": torch.tensor([1.0])}, {"w": torch.tensor([2.0])})
        Traceback (most recent call last):
        ...
        AssertionError: state: 1 leaves differ from the reference:
          w: 1/1 elements differ (bitwise); max |diff| = 1; first at (0,): 1.0 vs reference 2.0
    """
    pa, la, sa = optree.tree_flatten_with_path(unflat(actual))
    _, lb, sb = optree.tree_flatten_with_path(unflat(expected))
    if sa != sb:
        raise AssertionError(f"{what}: the pytree structures differ:\n  actual:    {sa}\n  reference: {sb}")
    problems = []
    for path, a, b in zip(pa, la, lb):
        msg = _describe_diff(path_str(path), a, b, rtol, atol)
        if msg is not None:
            problems.append(msg)
    if problems:
        more = f"\n  ... and {len(problems) - 5} more leaves" if len(problems) > 5 else ""
        raise AssertionError(f"{what}: {len(problems)} leaves differ from the reference:\n  "
                             + "\n  ".join(problems[:5]) + more)


def assert_pure(step: Callable, state: Any, batch: Any) -> tuple[Any, dict]:
    """Assert ``step`` is pure: the inputs bitwise unchanged by a call, a second call bitwise the same,
    torch's global RNG untouched for a seeded state (a ``donate=True`` compiled step consumes its input).

    Args:
        step, state, batch: the step ``step(state, batch) -> (state, metrics)`` and its inputs.

    Returns:
        The first call's output ``(state, metrics)``.

    Raises:
        AssertionError: naming which property failed, and the leaves.

    Example:
        >>> import torch, functrain as ft, functrain.testing as ftt
        >>> step = ft.train_step(lambda p, b, x: (p["w"] * x).sum(), ft.optim.adam(0.1))
        >>> new, metrics = ftt.assert_pure(step, step.init({"w": torch.ones(2)}), torch.ones(2))
        >>> int(new.step)
        1
    """
    state0, batch0, rng0 = clone_tree(state), clone_tree(batch), torch.get_rng_state()
    out = step(state, batch)
    assert_same_state(state, state0, what="the input state after a step (the step wrote into its input)")
    assert_same_state(batch, batch0, what="the input batch after a step (the step wrote into its input)")
    if getattr(state, "rng", None) is not None and not torch.equal(torch.get_rng_state(), rng0):
        raise AssertionError("the step changed torch's global RNG state although the state carries its own rng")
    again = step(state, batch)
    assert_same_state(again, out, what="a second call on the same (state, batch) (the step is not deterministic)")
    return out


def assert_compiled_equals_eager(step: Step, state: Any, batch: Any, steps: int = 3, rtol: float = 1e-5,
                                 atol: float = 1e-6, *, backend: Any = None, resync: bool = False,
                                 metrics_tol: tuple[float, float] | None = None, compiled: CompiledStep | None = None,
                                 **compile_kwargs: Any) -> CompiledStep:
    """Assert ``ft.compile(step)`` gives the eager step's states and metrics (allclose) for ``steps``
    steps, compiling on the first call and never recompiling afterwards.

    Args:
        step, state: the eager :class:`~functrain.Step` and the initial state.
        batch: one batch, or ``callable(i) -> batch``.
        steps: how many steps to compare (default 3).
        rtol, atol: the tolerances of the states (default ``1e-5`` and ``1e-6``).
        backend: ``None`` (default: inductor, which also checks its code generation: tens of
            seconds on a CPU), or ``"aot_eager"``: capture as one graph, no recompiles and
            equality in about a second.
        resync: ``True`` compares one step at a time (the eager step starts from the compiled
            state), for low-precision compute whose last-bit rounding would grow along the
            trajectory (default ``False``).
        metrics_tol: ``(rtol, atol)`` of the metrics (default ``None``: the states').
        compiled: a :class:`~functrain.CompiledStep` of ``step`` to reuse (default ``None``).
        **compile_kwargs: more arguments of :func:`functrain.compile`.

    Returns:
        The compiled step.

    Raises:
        AssertionError: nothing was compiled, a recompile happened, or a state or metric differs.

    Example:
        >>> import torch, functrain as ft, functrain.testing as ftt
        >>> step = ft.train_step(lambda p, b, x: (p["w"] * x).sum(), ft.optim.sgd(0.1))
        >>> ftt.assert_compiled_equals_eager(step, step.init({"w": torch.ones(2)}), torch.ones(2),
        ...                                  steps=2, backend="aot_eager").compiles
        1
    """
    if compiled is None:
        compiled = ft_compile(step, backend=backend, **compile_kwargs)
    before = compiled.compiles
    eager_state = compiled_state = state
    first = None
    for i in range(steps):
        b = _batch_at(batch, i)
        eager_state, eager_metrics = step(compiled_state if resync else eager_state, b)
        compiled_state, compiled_metrics = compiled(compiled_state, b)
        if first is None:
            first = compiled.compiles
            if first == before == 0:
                raise AssertionError("the compiled step compiled no graph on its first call (torch.compile ran "
                                     "it eagerly: a recompile limit, or compilation is disabled)")
        elif compiled.compiles != first:
            raise AssertionError(f"the compiled step recompiled at step {i} ({compiled.compiles - first} new "
                                 f"graphs after the first call); run with TORCH_LOGS=recompiles to see why")
        assert_same_state(compiled_state, eager_state, rtol, atol, what=f"compiled vs eager state after step {i}")
        assert_same_state(compiled_metrics, eager_metrics, *(metrics_tol or (rtol, atol)),
                          what=f"compiled vs eager metrics after step {i}")
    return compiled


def assert_order_independent(base_step: Step, transforms: Sequence[Any], state_args: Any, batch: Any,
                             steps: int = 2, rtol: float = 0.0, atol: float = 0.0) -> int:
    """Assert that every wrapping order of ``transforms`` around ``base_step`` gives the same states
    and metrics after ``steps`` steps (the transforms must be reusable, as functrain's are).

    Args:
        base_step: the step to wrap.
        transforms: the transforms, each ``transform(step) -> step``.
        state_args: ``(params,)``, ``(params, buffers)`` or a dict of :meth:`~functrain.Step.init` arguments.
        batch: one batch, or ``callable(i) -> batch``.
        steps: how many steps each order runs (default 2).
        rtol, atol: as :func:`assert_same_state` (default 0.0: bitwise).

    Returns:
        The number of orders checked (``len(transforms)!``).

    Raises:
        AssertionError: naming the two orders and the differing leaves.

    Example:
        >>> import torch, functrain as ft, functrain.testing as ftt
        >>> step = ft.train_step(lambda p, b, x: (p["w"] * x).sum(), ft.optim.sgd(0.1))
        >>> ftt.assert_order_independent(step, [ft.clip(1.0), ft.ema(0.9)], ({"w": torch.ones(3)},), torch.ones(3))
        2
    """
    reference, count = None, 0
    for count, order in enumerate(itertools.permutations(transforms), start=1):
        step = base_step
        for t in order:
            step = t(step)
        state = step.init(**state_args) if isinstance(state_args, dict) else step.init(*state_args)
        state, history = run_steps(step, state, batch, steps)
        names = " -> ".join(repr(t) for t in order)
        if reference is None:
            reference = (names, state, history)
        else:
            assert_same_state((state, history), reference[1:], rtol, atol,
                              what=f"wrapping order [{names}] vs [{reference[0]}]")
    return count
