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
    """Tensor shapes: tuples of ``min_dims..max_dims`` sizes in ``[min_side, max_side]``.

    Args:
        min_dims, max_dims: the fewest and most dimensions (default 0 and 3; 0: scalars too).
        min_side, max_side: the smallest and largest size of a dimension (default 1 and 5).

    Returns:
        A hypothesis ``SearchStrategy`` of tuples of ints.

    Example:
        >>> import functrain.testing as ftt; from hypothesis import find
        >>> find(ftt.shapes(min_dims=2), lambda shape: True)   # the simplest shape it draws
        (1, 1)
    """
    return st.lists(st.integers(min_side, max_side), min_size=min_dims, max_size=max_dims).map(tuple)


def tensors(shape: Any = None, dtype: torch.dtype = torch.float32, *, scale: float = 1.0,
            elements: st.SearchStrategy | None = None, device: Any = "cpu") -> st.SearchStrategy:
    """Tensors of ``shape``: ``randn * scale`` (floating), ``randint(0, 10)`` (integer) or coin flips
    (bool) from a drawn seed, fast for any size (hypothesis shrinks the shape and the seed).

    Args:
        shape: a tuple, a strategy of tuples, or ``None`` (default: :func:`shapes`).
        dtype: the dtype (default ``torch.float32``).
        scale: the standard deviation of floating values (default 1.0).
        elements: a strategy of Python numbers drawing every element (finds inf, NaN, subnormals;
            slower), or ``None`` (default: the seeded values).
        device: where the tensors are made (default ``"cpu"``).

    Returns:
        A hypothesis ``SearchStrategy`` of tensors.

    Example:
        >>> import torch, functrain.testing as ftt; from hypothesis import find
        >>> t = find(ftt.tensors((2, 3), torch.int64), lambda t: bool(t.sum() > 30))
        >>> t.shape, t.dtype
        (torch.Size([2, 3]), torch.int64)
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
    """Nested dicts, lists and tuples (each non-empty) of tensors: pytrees to test tree code on.

    Args:
        leaves: the strategy of the leaves (default ``None``: :func:`tensors`, float32, random shapes).
        max_depth: the most levels of nesting (default 2).
        max_children: the widest a container is (default 3).

    Returns:
        A hypothesis ``SearchStrategy`` of pytrees (a single leaf too).

    Example:
        >>> import functrain.testing as ftt; from hypothesis import find
        >>> tree = find(ftt.pytrees(), lambda tree: isinstance(tree, dict))
        >>> list(tree), tree["a"].dtype
        (['a'], torch.float32)
    """
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
    """Regression batches ``(x, y)`` (or ``{"x": x, "y": y}``) of float32 ``randn * scale``.

    Args:
        features, targets: the columns of ``x`` and ``y`` (default 4 and 1), ints or strategies.
        multiple_of: the rows are ``multiple_of * k`` (default 1), an int or a strategy.
        max_multiplier: the largest drawn ``k``, from 1 (default 4).
        scale: the standard deviation of ``x`` (default 1.0).
        as_dict: ``True`` gives ``{"x": x, "y": y}`` (default ``False``: a tuple).

    Returns:
        A hypothesis ``SearchStrategy`` of batches: ``x`` is ``(rows, features)``, ``y`` ``(rows, targets)``.

    Example:
        >>> import functrain.testing as ftt; from hypothesis import find
        >>> x, y = find(ftt.batches(features=3, multiple_of=2), lambda batch: True)
        >>> x.shape, y.shape
        (torch.Size([2, 3]), torch.Size([2, 1]))
    """

    @st.composite
    def draw_batch(draw):
        f, t, m = draw(_strategy(features)), draw(_strategy(targets)), draw(_strategy(multiple_of))
        rows = m * draw(st.integers(1, max_multiplier))
        gen = torch.Generator().manual_seed(draw(SEEDS))
        x, y = torch.randn(rows, f, generator=gen) * scale, torch.randn(rows, t, generator=gen)
        return {"x": x, "y": y} if as_dict else (x, y)

    return draw_batch()


class Problem(NamedTuple):
    """A drawn training problem (what :func:`mlp_problems` and :func:`token_problems` give).

    Attributes:
        params, buffers: the initial params and buffers, ``{name: tensor}`` (buffers ``{}`` here).
        loss_fn: a pure ``loss_fn(params, buffers, batch)``.
        batch: a batch whose rows divide by ``n``, the number of micro-batches to accumulate over.
        n: see ``batch``.
        mean_loss_fn: for :func:`token_problems`, the same loss as a plain token mean (the
            reference for ``aux["num_items"]``); ``None`` otherwise (default).

    Example:
        >>> import torch, functrain.testing as ftt
        >>> batch = (torch.ones(4, 2), torch.zeros(4, 1))
        >>> p = ftt.Problem({"w0": torch.ones(2, 1), "b0": torch.zeros(1)}, {}, ftt.mlp_loss, batch, n=2)
        >>> [x.shape[0] for x, _ in p.micro_batches()], float(p.loss_fn(p.params, p.buffers, p.batch))
        ([2, 2], 4.0)
    """

    params: dict
    buffers: dict
    loss_fn: Callable
    batch: Any
    n: int
    mean_loss_fn: Callable | None = None

    def micro_batches(self) -> list:
        """The batch split into its ``n`` micro-batches along dim 0 (as ``accumulate`` splits it).

        Returns:
            A list of ``n`` batches of the batch's structure.
        """
        leaves, spec = optree.tree_flatten(self.batch)
        return [optree.tree_unflatten(spec, [leaf.chunk(self.n)[i] for leaf in leaves]) for i in range(self.n)]


def mlp_loss(params: dict, buffers: dict, batch: Any) -> torch.Tensor:
    """The loss of :func:`mlp_problems`: a tanh MLP over params ``w0, b0, w1, ...``, MSE to ``y``.

    Args:
        params: weights ``w{i}`` ``(in, out)`` and biases ``b{i}`` ``(out,)``; tanh between layers.
        buffers: unused.
        batch: ``(x, y)`` or ``{"x": x, "y": y}``.

    Returns:
        The mean-squared error, a scalar tensor.

    Example:
        >>> import torch, functrain.testing as ftt
        >>> ftt.mlp_loss({"w0": torch.ones(2, 1), "b0": torch.zeros(1)}, {}, (torch.ones(3, 2), torch.ones(3, 1)))
        tensor(1.)
    """
    x, y = (batch["x"], batch["y"]) if isinstance(batch, dict) else batch
    depth = len(params) // 2
    for i in range(depth):
        x = x @ params[f"w{i}"] + params[f"b{i}"]
        if i < depth - 1:
            x = torch.tanh(x)
    return torch.nn.functional.mse_loss(x, y.to(x.dtype))


def mlp_problems(n: Any = None, *, min_width: int = 1, max_width: int = 8, max_hidden: int = 2,
                 max_micro_rows: int = 4, as_dict: bool = False) -> st.SearchStrategy:
    """A small tanh MLP regression :class:`Problem` with an MSE loss (:func:`mlp_loss`), weights
    ``randn / sqrt(fan_in)`` (activations of order one) and a batch of ``n * m`` rows.

    Args:
        n: the micro-batches to accumulate over, an int or a strategy (default ``None``: ``1..4``).
        min_width, max_width: the narrowest and widest layer (default 1 and 8).
        max_hidden: the most hidden layers (default 2).
        max_micro_rows: the most rows per micro-batch (default 4).
        as_dict: a ``{"x", "y"}`` batch (default ``False``: a tuple).

    Returns:
        A hypothesis ``SearchStrategy`` of :class:`Problem`.

    Example:
        >>> import functrain.testing as ftt; from hypothesis import find
        >>> problem = find(ftt.mlp_problems(n=2), lambda problem: True)
        >>> sorted(problem.params), len(problem.batch[0]), problem.n
        (['b0', 'w0'], 2, 2)
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
    """The loss of :func:`token_problems`: summed next-token cross-entropy, with ``aux["num_items"]``.

    Args:
        params: ``{"embed", "head", "bias"}`` of the tiny language model.
        buffers: unused.
        batch: ``{"tokens": int64 (rows, len + 1), "mask": bool (rows, len)}``.

    Returns:
        ``(sum over the unmasked positions, {"num_items": their count})``.

    Example:
        >>> import torch, functrain.testing as ftt
        >>> params = {"embed": torch.zeros(3, 2), "head": torch.zeros(2, 3), "bias": torch.zeros(3)}
        >>> batch = {"tokens": torch.tensor([[0, 1, 2]]), "mask": torch.tensor([[True, False]])}
        >>> loss, aux = ftt.token_sum_loss(params, {}, batch)   # one token, uniform over 3: log 3
        >>> round(float(loss), 4), int(aux["num_items"])
        (1.0986, 1)
    """
    losses, mask = _lm_token_losses(params, batch)
    return torch.where(mask, losses, 0.0).sum(), {"num_items": mask.sum()}


def token_mean_loss(params: dict, buffers: dict, batch: dict) -> torch.Tensor:
    """The reference for :func:`token_sum_loss`: the token mean over the whole batch.

    Args:
        params, buffers, batch: as :func:`token_sum_loss`.

    Returns:
        The mean next-token cross-entropy over the unmasked positions, a scalar tensor.

    Example:
        >>> import torch, functrain.testing as ftt
        >>> params = {"embed": torch.zeros(3, 2), "head": torch.zeros(2, 3), "bias": torch.zeros(3)}
        >>> batch = {"tokens": torch.tensor([[0, 1, 2]]), "mask": torch.tensor([[True, True]])}
        >>> round(float(ftt.token_mean_loss(params, {}, batch)), 4)
        1.0986
    """
    losses, mask = _lm_token_losses(params, batch)
    return torch.where(mask, losses, 0.0).sum() / mask.sum()


def token_problems(n: Any = None, *, max_vocab: int = 12, max_dim: int = 6, max_len: int = 7,
                   max_micro_rows: int = 3) -> st.SearchStrategy:
    """A tiny language model (embedding, tanh, linear head) on padded sequences of drawn lengths
    ``0..max_len`` (at least one predicted token): ``loss_fn`` :func:`token_sum_loss`, ``mean_loss_fn``
    :func:`token_mean_loss`, a batch as they take it with ``n * m`` rows.

    Args:
        n: the micro-batches, an int or a strategy (default ``None``: ``1..4``).
        max_vocab, max_dim, max_len: the largest vocabulary (from 2), embedding width and
            sequence length (default 12, 6 and 7).
        max_micro_rows: the most rows per micro-batch (default 3).

    Returns:
        A hypothesis ``SearchStrategy`` of :class:`Problem`.

    Example:
        >>> import functrain.testing as ftt; from hypothesis import find
        >>> problem = find(ftt.token_problems(n=2), lambda problem: True)
        >>> _, aux = problem.loss_fn(problem.params, problem.buffers, problem.batch)
        >>> int(aux["num_items"]) == int(problem.batch["mask"].sum()) > 0
        True
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
