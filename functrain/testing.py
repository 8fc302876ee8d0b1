"""Property-testing tools for functrain steps and the transforms you write.

functrain proves the laws of its own transforms (accumulation equals the big
batch, wrapping order does not matter, compiled equals eager, ...) with
`hypothesis <https://hypothesis.readthedocs.io>`_ property tests built from
this module. Use it to test your own :class:`functrain.Transform` the same way.
It needs hypothesis (``pip install functrain[test]``); ``import functrain``
does not import it.

Strategies (hypothesis ``SearchStrategy`` objects):
    :func:`shapes`, :func:`tensors`, :func:`pytrees` (nested dicts, lists and
    tuples of tensors), :func:`batches` (``(x, y)`` regression batches),
    :func:`mlp_problems` (a small MLP: params, a pure mean loss and a batch whose
    rows divide by a drawn ``n``), :func:`token_problems` (a tiny language model on
    variable-length padded sequences whose loss is a token sum with
    ``aux["num_items"]``).

Checkers (plain functions; they raise ``AssertionError`` naming the first
differing leaves):
    :func:`assert_same_state` (bitwise, or allclose), :func:`assert_pure`,
    :func:`assert_compiled_equals_eager` (and no recompiles),
    :func:`assert_order_independent` (every wrapping order gives the same state).

Example, a transform that scales the gradients, tested for purity, for
commuting with :func:`functrain.clip`, and for compiling to one graph::

    import torch, functrain as ft
    import functrain.testing as ftt
    from hypothesis import given, settings

    class ScaleGrads(ft.Transform):
        name, order = "scale_grads", 50          # stage "transform", after clip (10)

        def __init__(self, factor):
            self.factor = factor

        def transform(self, ctx):
            ctx.grads = ft.tree.tree_scale(ctx.grads, self.factor)

    @settings(deadline=None, max_examples=25)
    @given(ftt.mlp_problems())
    def test_scale_grads_laws(problem):
        step = ft.train_step(problem.loss_fn, ft.optim.adam(1e-2))
        state = ScaleGrads(0.5)(step).init(problem.params)
        ftt.assert_pure(ScaleGrads(0.5)(step), state, problem.batch)
        ftt.assert_order_independent(step, [ScaleGrads(0.5), ft.clip(0.1)], (problem.params,), problem.batch)

    @settings(deadline=None, max_examples=3)   # each example compiles (about a second with aot_eager)
    @given(ftt.mlp_problems())
    def test_scale_grads_compiles(problem):
        step = ScaleGrads(0.5)(ft.train_step(problem.loss_fn, ft.optim.sgd(0.1)))
        ftt.assert_compiled_equals_eager(step, step.init(problem.params), problem.batch,
                                         steps=10, backend="aot_eager")
"""
from __future__ import annotations

import itertools
import math
from typing import Any, Callable, NamedTuple, Sequence

import optree
import torch

try:
    from hypothesis import strategies as st
except ImportError as e:  # pragma: no cover - hypothesis is the "test" extra
    raise ImportError("functrain.testing needs hypothesis: pip install 'functrain[test]' "
                      "(or pip install hypothesis)") from e

from .core import tree as T
from .core.validate import path_str
from .core.flat import unflat
from .compiler.api import CompiledStep
from .compiler.api import compile as ft_compile
from .core.step import Step

__all__ = [
    "shapes", "tensors", "pytrees", "batches", "mlp_problems", "token_problems", "Problem",
    "mlp_loss", "token_sum_loss", "token_mean_loss",
    "assert_same_state", "assert_pure", "assert_compiled_equals_eager", "assert_order_independent",
    "run_steps", "clone_tree",
]

SEEDS = st.integers(0, 2**31 - 1)


def _strategy(value: Any) -> st.SearchStrategy:
    return value if isinstance(value, st.SearchStrategy) else st.just(value)


# -- strategies -------------------------------------------------------------------------------
def shapes(min_dims: int = 0, max_dims: int = 3, min_side: int = 1, max_side: int = 5) -> st.SearchStrategy:
    """Tensor shapes: tuples of ``min_dims..max_dims`` sizes in ``[min_side, max_side]``."""
    return st.lists(st.integers(min_side, max_side), min_size=min_dims, max_size=max_dims).map(tuple)


def tensors(shape: Any = None, dtype: torch.dtype = torch.float32, *, scale: float = 1.0,
            elements: st.SearchStrategy | None = None, device: Any = "cpu") -> st.SearchStrategy:
    """Tensors of ``shape`` (a tuple, a strategy of tuples, or ``None`` for :func:`shapes`).

    By default the values come from a drawn seed (``randn * scale`` for floating
    dtypes, ``randint(0, 10)`` for integers, coin flips for bool): fast for any size,
    and hypothesis shrinks the shape and the seed. With ``elements`` (a strategy of
    Python numbers, e.g. ``st.floats(allow_nan=True)``) every element is drawn by
    hypothesis instead, which finds edge values (inf, NaN, subnormals) but is slower.
    """
    shape_st = shapes() if shape is None else _strategy(shape)

    @st.composite
    def draw_tensor(draw):
        shp = tuple(draw(shape_st))
        if elements is not None:
            values = draw(st.lists(elements, min_size=math.prod(shp), max_size=math.prod(shp)))
            return torch.tensor(values, dtype=dtype, device=device).reshape(shp)
        gen = torch.Generator().manual_seed(draw(SEEDS))
        if dtype.is_floating_point:
            t = (torch.randn(shp, generator=gen, dtype=torch.float64) * scale).to(dtype)
        elif dtype == torch.bool:
            t = torch.randint(0, 2, shp, generator=gen).bool()
        else:
            t = torch.randint(0, 10, shp, generator=gen).to(dtype)
        return t.to(device)

    return draw_tensor()


def pytrees(leaves: st.SearchStrategy | None = None, *, max_depth: int = 2, max_children: int = 3) -> st.SearchStrategy:
    """Nested dicts, lists and tuples (each non-empty, at most ``max_children`` wide and
    ``max_depth`` deep) of ``leaves`` (default :func:`tensors`, float32 of random shapes)."""
    leaf = tensors() if leaves is None else leaves
    keys = st.text(alphabet="abcdefgh", min_size=1, max_size=3)
    tree = leaf
    for _ in range(max_depth):
        sub = tree
        tree = st.one_of(leaf,
                         st.dictionaries(keys, sub, min_size=1, max_size=max_children),
                         st.lists(sub, min_size=1, max_size=max_children),
                         st.lists(sub, min_size=1, max_size=max_children).map(tuple))
    return tree


def batches(features: Any = 4, targets: Any = 1, *, multiple_of: Any = 1, max_multiplier: int = 4,
            scale: float = 1.0, as_dict: bool = False) -> st.SearchStrategy:
    """Regression batches ``(x, y)`` (or ``{"x": x, "y": y}``) of float32 ``randn * scale``:
    ``x`` is ``(rows, features)``, ``y`` is ``(rows, targets)`` and ``rows = multiple_of * k``
    for a drawn ``k`` in ``[1, max_multiplier]``. Sizes may be ints or strategies."""

    @st.composite
    def draw_batch(draw):
        f, t, m = draw(_strategy(features)), draw(_strategy(targets)), draw(_strategy(multiple_of))
        rows = m * draw(st.integers(1, max_multiplier))
        gen = torch.Generator().manual_seed(draw(SEEDS))
        x, y = torch.randn(rows, f, generator=gen) * scale, torch.randn(rows, t, generator=gen)
        return {"x": x, "y": y} if as_dict else (x, y)

    return draw_batch()


class Problem(NamedTuple):
    """A drawn training problem: initial ``params`` and ``buffers``, a pure
    ``loss_fn(params, buffers, batch)``, a ``batch`` whose rows divide by ``n``, and,
    for :func:`token_problems`, ``mean_loss_fn``: the same loss as a plain token mean."""

    params: dict
    buffers: dict
    loss_fn: Callable
    batch: Any
    n: int
    mean_loss_fn: Callable | None = None

    def micro_batches(self) -> list:
        """The batch split into its ``n`` micro-batches along dim 0 (as ``accumulate`` splits it)."""
        leaves, spec = optree.tree_flatten(self.batch)
        return [optree.tree_unflatten(spec, [leaf.chunk(self.n)[i] for leaf in leaves]) for i in range(self.n)]


def mlp_loss(params: dict, buffers: dict, batch: Any) -> torch.Tensor:
    """The loss of :func:`mlp_problems`: a tanh MLP over params ``w0, b0, w1, ...``, MSE to ``y``."""
    x, y = (batch["x"], batch["y"]) if isinstance(batch, dict) else batch
    depth = len(params) // 2
    for i in range(depth):
        x = x @ params[f"w{i}"] + params[f"b{i}"]
        if i < depth - 1:
            x = torch.tanh(x)
    return torch.nn.functional.mse_loss(x, y.to(x.dtype))


def mlp_problems(n: Any = None, *, min_width: int = 1, max_width: int = 8, max_hidden: int = 2,
                 max_micro_rows: int = 4, as_dict: bool = False) -> st.SearchStrategy:
    """A small tanh MLP regression :class:`Problem` with a mean-squared-error loss.

    Params are ``{"w0", "b0", "w1", ...}`` (weights ``randn / sqrt(fan_in)``, so
    activations and gradients are of order one), the batch is ``(x, y)`` (or a dict
    with ``as_dict``) with ``n * m`` rows; ``n`` (an int or strategy, default
    ``1..4``) is the number of micro-batches to accumulate over. Every layer is
    ``min_width..max_width`` wide.
    """
    n_st = st.integers(1, 4) if n is None else _strategy(n)

    @st.composite
    def draw_problem(draw):
        widths = draw(st.lists(st.integers(min_width, max_width), min_size=2, max_size=max_hidden + 2))
        k = draw(n_st)
        batch = draw(batches(widths[0], widths[-1], multiple_of=k, max_multiplier=max_micro_rows, as_dict=as_dict))
        gen = torch.Generator().manual_seed(draw(SEEDS))
        params = {}
        for i, (a, b) in enumerate(zip(widths, widths[1:])):
            params[f"w{i}"] = torch.randn(a, b, generator=gen) / a ** 0.5
            params[f"b{i}"] = torch.randn(b, generator=gen) * 0.1
        return Problem(params, {}, mlp_loss, batch, k)

    return draw_problem()


def _lm_token_losses(params: dict, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    tokens, mask = batch["tokens"], batch["mask"]
    hidden = torch.tanh(params["embed"][tokens[:, :-1]])
    logits = hidden @ params["head"] + params["bias"]
    losses = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten(),
                                               reduction="none").view_as(mask)
    return losses, mask


def token_sum_loss(params: dict, buffers: dict, batch: dict):
    """The loss of :func:`token_problems`: summed token cross-entropy, with ``aux["num_items"]``."""
    losses, mask = _lm_token_losses(params, batch)
    return torch.where(mask, losses, 0.0).sum(), {"num_items": mask.sum()}


def token_mean_loss(params: dict, buffers: dict, batch: dict) -> torch.Tensor:
    """The reference for :func:`token_sum_loss`: the token mean over the whole batch."""
    losses, mask = _lm_token_losses(params, batch)
    return torch.where(mask, losses, 0.0).sum() / mask.sum()


def token_problems(n: Any = None, *, max_vocab: int = 12, max_dim: int = 6, max_len: int = 7,
                   max_micro_rows: int = 3) -> st.SearchStrategy:
    """A tiny language model (embedding, tanh, linear head) on padded sequences of drawn
    lengths ``0..max_len`` (at least one predicted token in the batch).

    ``loss_fn`` returns the *sum* of next-token cross-entropies over the non-padded
    positions with ``aux["num_items"]`` = their count; ``mean_loss_fn`` is the big-batch
    token mean (the reference for item-count normalisation). The batch is
    ``{"tokens": int64 (rows, len + 1), "mask": bool (rows, len)}`` with ``n * m`` rows.
    """
    n_st = st.integers(1, 4) if n is None else _strategy(n)

    @st.composite
    def draw_problem(draw):
        k, vocab, dim = draw(n_st), draw(st.integers(2, max_vocab)), draw(st.integers(1, max_dim))
        rows, length = k * draw(st.integers(1, max_micro_rows)), draw(st.integers(1, max_len))
        lengths = draw(st.lists(st.integers(0, length), min_size=rows, max_size=rows).filter(any))
        gen = torch.Generator().manual_seed(draw(SEEDS))
        tokens = torch.randint(0, vocab, (rows, length + 1), generator=gen)
        mask = torch.arange(length)[None, :] < torch.tensor(lengths)[:, None]
        params = {"embed": torch.randn(vocab, dim, generator=gen), "bias": torch.zeros(vocab),
                  "head": torch.randn(dim, vocab, generator=gen) / dim ** 0.5}
        return Problem(params, {}, token_sum_loss, {"tokens": tokens, "mask": mask}, k, token_mean_loss)

    return draw_problem()


# -- helpers ------------------------------------------------------------------------------------
def clone_tree(tree: Any) -> Any:
    """A copy of ``tree`` whose tensor leaves are fresh clones (other leaves shared)."""
    return optree.tree_map(lambda x: x.detach().clone() if torch.is_tensor(x) else x, tree)


def _batch_at(batch: Any, i: int) -> Any:
    return batch(i) if callable(batch) else batch


def run_steps(step: Callable, state: Any, batch: Any, steps: int = 1) -> tuple[Any, list]:
    """Run ``steps`` steps from ``state``; ``batch`` is one batch or ``callable(i) -> batch``.
    Returns the final state and the list of per-step metrics."""
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
    """Assert two pytrees (states, metrics, anything) match: the same structure and, leaf
    by leaf, bitwise-equal tensors when ``rtol == atol == 0`` (the default), else
    ``allclose(actual, expected, rtol, atol)`` with NaNs equal (integer and bool
    leaves always exactly). ``expected`` is the reference. Flat params (:func:`functrain.flat`) are
    compared by name: a flat state matches the plain state it stands for."""
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
    """Assert ``step`` is pure on ``(state, batch)``: the inputs are bitwise unchanged by a
    call, a second call with the same inputs gives bitwise the same state and metrics,
    and (for a seeded state) torch's global RNG is left as it was. Returns the output.
    (A ``ft.compile(step, donate=True)`` step consumes its input by design.)"""
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
    """Assert ``ft.compile(step)`` gives the eager step's states and metrics (allclose) for
    ``steps`` steps, compiling on the first call and never recompiling afterwards.

    ``batch`` is one batch or ``callable(i) -> batch``. ``backend="aot_eager"`` checks
    capture as one graph (fullgraph), no recompiles and equality in about a second;
    the default inductor backend also checks its code generation (tens of seconds on a
    CPU). ``resync=True`` compares one step at a time (the eager step starts from the
    compiled state each step), for low-precision compute where different kernels'
    last-bit rounding would otherwise grow along the trajectory; ``metrics_tol=(rtol,
    atol)`` then sets the metrics' own tolerance (a loss computed in fp16 is only good to
    fp16's precision). Pass ``compiled`` to reuse a :class:`~functrain.CompiledStep` of
    ``step``. Returns the compiled step.
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
    """Assert that every wrapping order of ``transforms`` around ``base_step`` gives the same
    states and metrics after ``steps`` steps (bitwise by default; see
    :func:`assert_same_state`). ``state_args`` is ``(params,)``, ``(params, buffers)`` or
    a dict of :meth:`~functrain.Step.init` arguments; ``batch`` is one batch or
    ``callable(i) -> batch``. The transforms are applied as given to every order, so
    they must be reusable (as functrain's are). Returns the number of orders checked."""
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
