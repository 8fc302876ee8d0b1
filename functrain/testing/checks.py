"""Law checkers for functrain steps: bitwise or allclose state comparison, the norm-wise law of low-precision
compute, purity, compiled equals eager, order independence of transforms; a state at step ``t``. Re-exported by
:mod:`functrain.testing`."""
from __future__ import annotations

import itertools
import math
from typing import Any, Callable, Sequence

import optree
import torch

from ..core import tree as T
from ..core.validate import BadValue, check_int, check_real, describe, path_str
from ..core.flat import unflat
from ..core.state import TrainState
from ..compiler.api import CompiledStep
from ..compiler.api import compile as ft_compile
from ..core.step import Step
from .probe import probe as make_probe

__all__ = ["assert_same_state", "assert_pure", "assert_compiled_equals_eager", "assert_order_independent",
           "assert_close_normwise", "LAW_EPS", "law_dtype", "with_step", "state_at", "run_steps", "clone_tree"]


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


# -- a state at step t --------------------------------------------------------------------------
def with_step(state: TrainState, t: int, *, updates: int | None = None,
              slots: dict[str, Callable[[Any, int], Any]] | None = None) -> TrainState:
    """``state`` moved to step ``t``: every counter a step reads set as after ``t`` calls, the tensors unchanged.

    Set: ``state.step`` (the calls counted), the optimizer state's ``count`` (the updates taken: what a
    learning-rate schedule and Adam's bias correction read; the optimizer protocol declares it) and the counter
    of ``state.rng``'s key (which step's random numbers the next call draws). A transform's own counters are
    its own: pass ``slots={name: fn(slot, t) -> slot}`` for them (``ft.ema``'s is ``slot.count``).

    Args:
        state: a :class:`~functrain.TrainState` (from ``step.init``, or any step's output).
        t: the step, an int >= 0.
        updates: the optimizer's ``count`` (default ``None``: ``t``, every call an update; ``t // n`` for a
            streaming ``accumulate(n)``).
        slots: ``{slot name: fn(slot, t) -> new slot}`` for the transforms' own counters (default none).

    Returns:
        The new state (a new :class:`~functrain.TrainState`; ``state`` is unchanged).

    Raises:
        ValueError: ``t`` or ``updates`` not an int >= 0, a slot the state does not have, or an optimizer
            state without the protocol's ``count`` (``BadValue``, also a ``TypeError``).

    Example:
        >>> import torch, functrain as ft, functrain.testing as ftt
        >>> lr = ft.optim.schedules.linear_warmup(1.0, warmup_steps=10)
        >>> step = ft.train_step(lambda p, b, x: (p["w"] * x).sum(), ft.optim.sgd(lr))
        >>> state = ftt.with_step(step.init({"w": torch.zeros(1)}), 5)
        >>> int(state.step), int(state.opt_state.count), state.rng["key"].tolist()
        (5, 5, [0, 5])
        >>> float(step.optimizer.learning_rate(state.opt_state))   # the schedule reads the count
        0.5
    """
    if not isinstance(state, TrainState):
        raise BadValue(f"with_step: state must be a TrainState (from step.init); got {describe(state, 80)}")
    t = check_int("with_step: t", t, minimum=0)
    updates = t if updates is None else check_int("with_step: updates", updates, minimum=0)
    new_slots = dict(state.slots)
    for name, fn in (slots or {}).items():
        if name not in new_slots:
            raise BadValue(f"with_step: slots names {name!r}, which this state does not have; its slots are "
                           f"{sorted(new_slots)}")
        if not callable(fn):
            raise BadValue(f"with_step: slots[{name!r}] must be callable(slot, t) -> slot; got {describe(fn, 80)}")
        new_slots[name] = fn(new_slots[name], t)
    opt_state = state.opt_state
    try:  # the optimizer protocol's declared field (functrain.optim.base.Optimizer.init)
        count = opt_state.count
    except AttributeError:
        raise BadValue(f"with_step: the optimizer state has no 'count' (the updates taken, which the optimizer "
                       f"protocol declares); got {type(opt_state).__name__}") from None
    opt_state = opt_state._replace(count=torch.full_like(count, updates))
    rng = state.rng
    if rng is not None:
        seed = int(rng["key"][0])
        rng = {**rng, "key": torch.tensor([seed, t], dtype=rng["key"].dtype, device=rng["key"].device)}
    return state._replace(step=torch.full_like(state.step, t), opt_state=opt_state, rng=rng, slots=new_slots)


def state_at(step: Step, params: Any, t: int, buffers: Any = None, *, seed: int | None = 0,
             updates: int | None = None, slots: dict[str, Callable[[Any, int], Any]] | None = None) -> TrainState:
    """``step.init(params, buffers, seed=seed)`` at step ``t`` (:func:`with_step`), checked by
    ``step.check_state``.

    Args:
        step: the :class:`~functrain.Step`.
        params, buffers, seed: as :meth:`functrain.Step.init`.
        t, updates, slots: as :func:`with_step`.

    Returns:
        The state, valid for ``step``.

    Example:
        >>> import torch, functrain as ft, functrain.testing as ftt
        >>> step = ft.ema(0.9)(ft.train_step(lambda p, b, x: (p["w"] * x).sum(), ft.optim.adam(0.1)))
        >>> state = ftt.state_at(step, {"w": torch.ones(2)}, 100,
        ...                      slots={"ema": lambda slot, t: slot._replace(count=torch.tensor(t))})
        >>> int(state.step), int(state.opt_state.count), int(state.slots["ema"].count)
        (100, 100, 100)
    """
    if not isinstance(step, Step):
        raise BadValue(f"state_at: step must be a functrain Step (from ft.train_step); got {describe(step, 80)}")
    state = with_step(step.init(params, buffers, seed=seed), t, updates=updates, slots=slots)
    step.check_state(state)
    return state


# -- the norm-wise law of low-precision compute ---------------------------------------------------
LAW_EPS = 8.0
"""The documented law of bf16/fp16 compute (docs/transforms.md, "Their laws"): a gradient computed in the compute
dtype is within ``LAW_EPS`` machine epsilons of that dtype of the fp32 gradient, relative and norm-wise."""

_DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16}


def law_dtype(dtype: Any) -> torch.dtype:
    """The compute dtype of a law: ``torch.bfloat16`` / ``torch.float16`` (or ``"bf16"`` / ``"fp16"``), or
    another floating torch dtype; a clear error otherwise."""
    if isinstance(dtype, str) and dtype in _DTYPES:
        return _DTYPES[dtype]
    if isinstance(dtype, torch.dtype) and dtype.is_floating_point:
        return dtype
    raise BadValue(f"the law's dtype must be torch.bfloat16, torch.float16 (or 'bf16', 'fp16'), or another "
                   f"floating torch dtype; got {describe(dtype, 80)}")


def _as_vector(leaves: list) -> torch.Tensor:
    return torch.cat([x.detach().reshape(-1).to("cpu", torch.float64) for x in leaves]) if leaves else \
        torch.zeros(0, dtype=torch.float64)


def assert_close_normwise(actual: Any, expected: Any, *, dtype: Any, origin: Any = None, multiple: float = LAW_EPS,
                          what: str = "tree") -> float:
    """Assert the norm-wise law of low-precision compute: ``||actual - expected|| <= multiple * eps(dtype) *
    ||expected - origin||``, the norms over all floating elements of the trees together (float64), ``eps`` the
    machine epsilon of ``dtype`` (``2**-7`` for bf16, ``2**-10`` for fp16).

    The law (docs/transforms.md) bounds the *gradient*: compare gradients (read with :func:`probe`) of a
    bf16/fp16 step with the fp32 step's at the default ``multiple=8``. An update is bounded by it only when the
    optimizer is linear in the gradient (SGD, with or without momentum: pass ``origin=`` the params both started
    from, and the new params); an adaptive optimizer's (Adam, AdamW, Lion) is not, see the docs.

    Args:
        actual, expected: the trees (same structure; a flat state compares by name) under test and the reference.
        dtype: the compute dtype: ``torch.bfloat16``, ``torch.float16`` (or ``"bf16"``, ``"fp16"``).
        origin: a tree both started from (default ``None``: zeros), so that the bound is relative to
            ``expected - origin`` (an update) rather than to ``expected``.
        multiple: the bound in machine epsilons of ``dtype`` (default :data:`LAW_EPS`, 8: the documented law;
            16 for two low-precision results each within 8 of fp32's).
        what: the name of the compared thing in the message (default ``"tree"``).

    Returns:
        The measured ``||actual - expected|| / ||expected - origin||`` in epsilons of ``dtype``.

    Raises:
        AssertionError: the structures, shapes or integer leaves differ, a non-finite element differs, or the
            bound fails: the message gives both norms, the bound and the leaves that differ most.
        ValueError: ``dtype`` or ``multiple`` is not allowed (``BadValue``, also a ``TypeError``).

    Example:
        >>> import torch, functrain.testing as ftt
        >>> expected = {"w": torch.ones(256)}
        >>> flipped = {"w": torch.cat([torch.ones(255), torch.tensor([-1.0])])}   # one element's sign: 2/16
        >>> ftt.assert_close_normwise({"w": expected["w"] * (1 + 2**-9)}, expected, dtype=torch.bfloat16)
        0.25
        >>> ftt.assert_close_normwise(flipped, expected, dtype=torch.bfloat16)
        Traceback (most recent call last):
        ...
        AssertionError: tree: |actual - expected| = 2 is 16 eps of torch.bfloat16 (2**-7) times |expected| = 16, \
above the law's 8 eps; the leaves that differ most: w (|diff| 2, 1/256 elements)
    """
    dt = law_dtype(dtype)
    multiple = check_real("assert_close_normwise: multiple", multiple, lo=0)
    eps = torch.finfo(dt).eps
    pa, la, sa = optree.tree_flatten_with_path(unflat(actual))
    _, lb, sb = optree.tree_flatten_with_path(unflat(expected))
    if sa != sb:
        raise AssertionError(f"{what}: the pytree structures differ:\n  actual:    {sa}\n  reference: {sb}")
    if origin is None:
        lo = [None] * len(lb)
    else:
        _, lo, so = optree.tree_flatten_with_path(unflat(origin))
        if so != sb:
            raise AssertionError(f"{what}: the origin's pytree structure differs from the reference's:\n  "
                                 f"origin:    {so}\n  reference: {sb}")
    diffs, refs, per_leaf, exact = [], [], [], []
    for path, a, b, o in zip(pa, la, lb, lo):
        name = path_str(path)
        if not (torch.is_tensor(a) and torch.is_tensor(b) and a.is_floating_point() and b.is_floating_point()):
            msg = _describe_diff(name, a, b, 0.0, 0.0)
            if msg is not None:
                exact.append(msg)
            continue
        if a.shape != b.shape:
            exact.append(f"{name}: shape {tuple(a.shape)} vs {tuple(b.shape)}")
            continue
        a64, b64 = a.detach().to("cpu", torch.float64), b.detach().to("cpu", torch.float64)
        finite = torch.isfinite(b64)
        if not torch.equal(torch.isfinite(a64), finite) or not torch.equal(a64[~finite].nan_to_num(), b64[~finite].nan_to_num()):
            exact.append(f"{name}: its non-finite elements differ ({int((~torch.isfinite(a64)).sum())} vs "
                         f"{int((~finite).sum())} in the reference, or other values)")
            continue
        d = (a64 - b64)[finite]
        r = (b64 - (0.0 if o is None else o.detach().to("cpu", torch.float64)))[finite]
        diffs.append(d)
        refs.append(r)
        per_leaf.append((float(d.norm()), name, int((d != 0).sum()), d.numel()))
    if exact:
        raise AssertionError(f"{what}: {len(exact)} leaves differ where the law asks for equality:\n  "
                             + "\n  ".join(exact[:5]))
    diff, ref = float(_as_vector(diffs).norm()), float(_as_vector(refs).norm())
    measured = diff / (eps * ref) if ref > 0 else (0.0 if diff == 0 else math.inf)
    if measured > multiple:
        worst = sorted(per_leaf, reverse=True)[:3]
        leaves = ", ".join(f"{n} (|diff| {d:.4g}, {k}/{m} elements)" for d, n, k, m in worst if d > 0)
        of = "|expected - origin|" if origin is not None else "|expected|"
        raise AssertionError(f"{what}: |actual - expected| = {diff:.4g} is {measured:.4g} eps of {dt} "
                             f"(2**{int(math.log2(eps))}) times {of} = {ref:.4g}, above the law's {multiple:g} eps; "
                             f"the leaves that differ most: {leaves}")
    return measured


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


def assert_compiled_equals_eager(step: Step, state: Any, batch: Any, steps: int = 3, rtol: float | None = None,
                                 atol: float | None = None, *, backend: Any = None, resync: bool = False,
                                 metrics_tol: tuple[float, float] | None = None, compiled: CompiledStep | None = None,
                                 law: Any = None, **compile_kwargs: Any) -> CompiledStep:
    """Assert ``ft.compile(step)`` gives the eager step's states and metrics (allclose) for ``steps``
    steps, compiling on the first call and never recompiling afterwards.

    With ``law=torch.bfloat16`` (or ``torch.float16``) the comparison is the documented law of low-precision
    compute instead of element-wise: a compiled kernel rounds in another order than eager's (inductor fuses
    a chain and rounds once), a last-bit difference in a gradient element near 0 can flip its sign, and an
    adaptive optimizer (Adam, AdamW, Lion: each element's update divided by ``sqrt(v)``, or its sign) then
    moves that element by up to ``2 * lr``, which no tolerance on the params absorbs. So, one step at a
    time from the compiled state (``resync`` implied), the gradient the optimizer receives (read with
    :func:`probe` at stage ``"update"``, ``outputs=True``) and each floating metric must be within
    ``2 * LAW_EPS`` = 16 epsilons of ``law``, norm-wise (:func:`assert_close_normwise`: each is within 8 of
    the fp32 value, so the two within 16); integer and bool leaves (counters, ``skipped``) and the states'
    structure must be equal, and the states' non-finite elements the same; the states' floating values are
    compared element-wise only where ``rtol``/``atol`` are given.

    Args:
        step, state: the eager :class:`~functrain.Step` and the initial state.
        batch: one batch, or ``callable(i) -> batch``.
        steps: how many steps to compare (default 3).
        rtol, atol: the tolerances of the states (default ``None``: ``1e-5`` and ``1e-6``; with ``law``, the
            states' floating values are then not compared element-wise).
        backend: ``None`` (default: inductor, which also checks its code generation: tens of
            seconds on a CPU), or ``"aot_eager"``: capture as one graph, no recompiles and
            equality in about a second.
        resync: ``True`` compares one step at a time (the eager step starts from the compiled
            state), for low-precision compute whose last-bit rounding would grow along the
            trajectory (default ``False``).
        metrics_tol: ``(rtol, atol)`` of the metrics (default ``None``: the states', or with ``law`` the law).
        compiled: a :class:`~functrain.CompiledStep` of ``step`` to reuse (default ``None``; not with ``law``,
            which compiles the probed step).
        law: ``None`` (default: element-wise), or the compute dtype whose norm-wise law applies:
            ``torch.bfloat16``, ``torch.float16`` (or ``"bf16"``, ``"fp16"``).
        **compile_kwargs: more arguments of :func:`functrain.compile`.

    Returns:
        The compiled step (with ``law``: of the probed step, whose metrics hold ``"probe/law_grads"``).

    Raises:
        AssertionError: nothing was compiled, a recompile happened, or a state or metric differs (beyond the law).

    Example:
        >>> import torch, functrain as ft, functrain.testing as ftt
        >>> step = ft.train_step(lambda p, b, x: (p["w"] * x).sum(), ft.optim.sgd(0.1))
        >>> ftt.assert_compiled_equals_eager(step, step.init({"w": torch.ones(2)}), torch.ones(2),
        ...                                  steps=2, backend="aot_eager").compiles
        1
    """
    if law is not None:
        return _compiled_within_law(step, state, batch, steps, rtol, atol, law_dtype(law), backend, metrics_tol,
                                    compiled, compile_kwargs)
    rtol, atol = 1e-5 if rtol is None else rtol, 1e-6 if atol is None else atol
    if compiled is None:
        compiled = ft_compile(step, backend=backend, **compile_kwargs)
    before = compiled.compiles
    eager_state = compiled_state = state
    first = None
    for i in range(steps):
        b = _batch_at(batch, i)
        eager_state, eager_metrics = step(compiled_state if resync else eager_state, b)
        compiled_state, compiled_metrics = compiled(compiled_state, b)
        first = _check_compiles(compiled, before, first, i)
        assert_same_state(compiled_state, eager_state, rtol, atol, what=f"compiled vs eager state after step {i}")
        assert_same_state(compiled_metrics, eager_metrics, *(metrics_tol or (rtol, atol)),
                          what=f"compiled vs eager metrics after step {i}")
    return compiled


def _check_compiles(compiled: CompiledStep, before: int, first: int | None, i: int) -> int:
    """After call ``i``: the first call compiled a graph, and no later call compiled another."""
    if first is None:
        if compiled.compiles == before == 0:
            raise AssertionError("the compiled step compiled no graph on its first call (torch.compile ran "
                                 "it eagerly: a recompile limit, or compilation is disabled)")
        return compiled.compiles
    if compiled.compiles != first:
        raise AssertionError(f"the compiled step recompiled at step {i} ({compiled.compiles - first} new "
                             f"graphs after the first call); run with TORCH_LOGS=recompiles to see why")
    return first


def _compiled_within_law(step: Step, state: Any, batch: Any, steps: int, rtol: float | None, atol: float | None,
                         dtype: torch.dtype, backend: Any, metrics_tol: tuple[float, float] | None,
                         compiled: CompiledStep | None, compile_kwargs: dict) -> CompiledStep:
    if compiled is not None:
        raise BadValue("assert_compiled_equals_eager: law= compiles the step with a gradient probe itself; "
                       "drop compiled= (or compare element-wise without law=)")
    if (rtol is None) != (atol is None):
        raise BadValue(f"assert_compiled_equals_eager: with law=, give both rtol and atol (to also compare the "
                       f"states element-wise) or neither; got rtol={rtol!r}, atol={atol!r}")
    probed, seen = make_probe(step, "update", fields=("grads",), name="law_grads", outputs=True)
    compiled = ft_compile(probed, backend=backend, **compile_kwargs)
    before, first, multiple = compiled.compiles, None, 2 * LAW_EPS
    for i in range(steps):
        b = _batch_at(batch, i)
        eager_state, eager_metrics = probed(state, b)
        new_state, compiled_metrics = compiled(state, b)
        first = _check_compiles(compiled, before, first, i)
        when = f"after step {i}"
        assert_close_normwise(compiled_metrics.pop(seen.key), eager_metrics.pop(seen.key), dtype=dtype,
                              multiple=multiple, what=f"compiled vs eager gradient (the optimizer's input) {when}")
        if metrics_tol is not None:
            assert_same_state(compiled_metrics, eager_metrics, *metrics_tol, what=f"compiled vs eager metrics {when}")
        else:
            _assert_tree_within_law(compiled_metrics, eager_metrics, dtype, multiple, f"compiled vs eager metrics {when}")
        _assert_same_but_floats(new_state, eager_state, f"compiled vs eager state {when}")
        if rtol is not None:
            assert_same_state(new_state, eager_state, rtol, atol, what=f"compiled vs eager state {when}")
        state = new_state
    return compiled


def _assert_tree_within_law(actual: Any, expected: Any, dtype: torch.dtype, multiple: float, what: str) -> None:
    """Each floating leaf of ``actual`` within the law of its ``expected`` leaf (norm-wise); the rest equal."""
    _assert_same_but_floats(actual, expected, what)
    pa, la, _ = optree.tree_flatten_with_path(unflat(actual))
    for path, a, b in zip(pa, la, optree.tree_leaves(unflat(expected))):
        if torch.is_tensor(a) and a.is_floating_point():
            assert_close_normwise(a, b, dtype=dtype, multiple=multiple, what=f"{what}: {path_str(path)}")


def _assert_same_but_floats(actual: Any, expected: Any, what: str) -> None:
    """The structure, shapes and dtypes equal, the non-floating leaves bitwise, the floats non-finite alike."""
    pa, la, sa = optree.tree_flatten_with_path(unflat(actual))
    _, lb, sb = optree.tree_flatten_with_path(unflat(expected))
    if sa != sb:
        raise AssertionError(f"{what}: the pytree structures differ:\n  actual:    {sa}\n  reference: {sb}")
    problems = []
    for path, a, b in zip(pa, la, lb):
        name = path_str(path)
        if torch.is_tensor(a) and torch.is_tensor(b) and a.is_floating_point() and b.is_floating_point():
            if a.shape != b.shape or a.dtype != b.dtype:
                problems.append(f"{name}: {tuple(a.shape)} {a.dtype} vs {tuple(b.shape)} {b.dtype}")
            elif not torch.equal(torch.isfinite(a), torch.isfinite(b)):
                problems.append(f"{name}: non-finite at other elements ({int((~torch.isfinite(a)).sum())} vs "
                                f"{int((~torch.isfinite(b)).sum())} in the reference)")
            continue
        msg = _describe_diff(name, a, b, 0.0, 0.0)
        if msg is not None:
            problems.append(msg)
    if problems:
        raise AssertionError(f"{what}: {len(problems)} leaves differ from the reference:\n  "
                             + "\n  ".join(problems[:5]))


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
