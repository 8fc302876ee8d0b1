"""Hypothesis strategies for functrain steps: shapes, tensors, pytrees, batches, and small problems (an MLP, a
token language model) with their losses. Re-exported by :mod:`functrain.testing`."""
from __future__ import annotations

import math
from typing import Any, NamedTuple

import optree
import torch

try:
    from hypothesis import strategies as st
except ImportError as e:  # pragma: no cover - hypothesis is the "test" extra
    raise ImportError("functrain.testing needs hypothesis: pip install 'functrain[test]' "
                      "(or pip install hypothesis)") from e

from ..core.flat import unflat

__all__ = ["shapes", "tensors", "pytrees", "batches", "mlp_problems", "token_problems", "nd_params", "nd_problems",
           "Problem", "mlp_loss", "token_sum_loss", "token_mean_loss", "nd_loss", "SEEDS"]

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



def _nd_contribution(p: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """One parameter's term of :func:`nd_loss`, one value per row (see there)."""
    if p.dim() == 0:
        return torch.tanh(x * p)
    if p.dim() == 1:
        return torch.tanh(x @ p)
    if p.dim() == 2:
        return torch.tanh(x @ p).mean(-1)
    if p.dim() == 3:
        return torch.tanh(torch.einsum("ra,abc->rbc", x, p)).mean((1, 2))
    if p.dim() == 4:
        return torch.tanh(torch.nn.functional.conv2d(x, p)).mean((1, 2, 3))
    raise ValueError(f"nd_loss: params of 0 to 4 dimensions; got one of shape {tuple(p.shape)}")


def nd_loss(params: dict, buffers: dict, batch: dict) -> torch.Tensor:
    """The loss of :func:`nd_problems`: each parameter, whatever its number of dimensions, maps its own input
    ``batch["x"][name]`` to one value per row through a tanh, and the MSE of their sum to ``batch["y"]``.

    The term of a parameter ``p`` with input ``x``: a scalar, ``tanh(x * p)`` (``x``: ``(rows,)``); a vector,
    ``tanh(x @ p)`` (``x``: ``(rows, a)``); a matrix ``(a, b)``, ``tanh(x @ p)`` averaged over ``b``; 3-D ``(a, b,
    c)``, ``tanh(einsum("ra,abc->rbc", x, p))`` averaged; 4-D ``(out, in, kh, kw)``, a convolution filter:
    ``tanh(conv2d(x, p))`` averaged, ``x`` an image batch ``(rows, in, h, w)``. Every parameter reaches the
    loss, and its gradient depends on the data.

    Args:
        params: ``{name: tensor of 0 to 4 dimensions}``.
        buffers: unused.
        batch: ``{"x": {name: input}, "y": (rows,)}``.

    Returns:
        The mean-squared error, a scalar tensor.

    Example:
        >>> import torch, functrain.testing as ftt
        >>> params = {"s": torch.tensor(0.0), "k": torch.zeros(1, 2, 2, 2)}
        >>> batch = {"x": {"s": torch.ones(3), "k": torch.ones(3, 2, 3, 3)}, "y": torch.ones(3)}
        >>> ftt.nd_loss(params, {}, batch)
        tensor(1.)
    """
    x, y = batch["x"], batch["y"]
    pred = sum(_nd_contribution(p, x[name]) for name, p in params.items())
    return torch.nn.functional.mse_loss(pred, y.to(pred.dtype))


def nd_params(*, min_ndim: int = 0, max_ndim: int = 4, min_params: int = 1, max_params: int = 4,
              max_side: int = 3) -> st.SearchStrategy:
    """Params ``{"p0": ..., "p1": ...}`` of ``min_ndim..max_ndim`` dimensions each (scalars, vectors,
    matrices, 3-D, 4-D convolution filters), sides ``1..max_side``, values ``randn / sqrt(fan_in)``.

    Args:
        min_ndim, max_ndim: the fewest and most dimensions of a parameter, in ``[0, 4]`` (default 0 and 4).
        min_params, max_params: how many parameters (default 1 to 4).
        max_side: the largest size of a dimension (default 3).

    Returns:
        A hypothesis ``SearchStrategy`` of ``{name: float32 tensor}`` dicts.

    Example:
        >>> import functrain.testing as ftt; from hypothesis import find
        >>> params = find(ftt.nd_params(min_params=2), lambda p: {t.dim() for t in p.values()} >= {0, 4})
        >>> sorted(t.dim() for t in params.values())
        [0, 4]
    """
    if not (0 <= min_ndim <= max_ndim <= 4):
        raise ValueError(f"nd_params: need 0 <= min_ndim <= max_ndim <= 4; got min_ndim={min_ndim!r}, "
                         f"max_ndim={max_ndim!r}")
    if not (1 <= min_params <= max_params) or max_side < 1:
        raise ValueError(f"nd_params: need 1 <= min_params <= max_params and max_side >= 1; got "
                         f"min_params={min_params!r}, max_params={max_params!r}, max_side={max_side!r}")

    @st.composite
    def draw_params(draw):
        shapes_ = draw(st.lists(shapes(min_ndim, max_ndim, 1, max_side), min_size=min_params, max_size=max_params))
        gen = torch.Generator().manual_seed(draw(SEEDS))
        params = {}
        for i, shape in enumerate(shapes_):
            fan_in = math.prod(shape[1:]) if len(shape) == 4 else (shape[0] if shape else 1)
            params[f"p{i}"] = torch.randn(shape, generator=gen) / fan_in ** 0.5
        return params

    return draw_params()


def _nd_input(p: torch.Tensor, rows: int, extra: int, gen: torch.Generator) -> torch.Tensor:
    """An input of :func:`nd_loss` for ``p``: ``(rows,)``, ``(rows, a)``, or images ``extra`` larger than the filter."""
    if p.dim() == 0:
        return torch.randn(rows, generator=gen)
    if p.dim() == 4:
        return torch.randn(rows, p.shape[1], p.shape[2] + extra, p.shape[3] + extra, generator=gen)
    return torch.randn(rows, p.shape[0], generator=gen)


def nd_problems(n: Any = None, *, min_ndim: int = 0, max_ndim: int = 4, min_params: int = 1, max_params: int = 4,
                max_side: int = 3, max_micro_rows: int = 4) -> st.SearchStrategy:
    """A :class:`Problem` whose params have any number of dimensions from ``min_ndim`` to ``max_ndim``
    (:func:`nd_params`): loss :func:`nd_loss`, a batch ``{"x": {name: input}, "y": targets}`` of ``n * m``
    rows (4-D filters see images 0 to 2 pixels larger than themselves).

    Args:
        n: the micro-batches, an int or a strategy (default ``None``: ``1..4``).
        min_ndim, max_ndim, min_params, max_params, max_side: as :func:`nd_params`.
        max_micro_rows: the most rows per micro-batch (default 4).

    Returns:
        A hypothesis ``SearchStrategy`` of :class:`Problem`.

    Example:
        >>> import functrain.testing as ftt; from hypothesis import find
        >>> problem = find(ftt.nd_problems(n=2, min_ndim=4), lambda problem: True)
        >>> problem.params["p0"].dim(), problem.batch["x"]["p0"].shape[0], problem.n
        (4, 2, 2)
    """
    n_st = st.integers(1, 4) if n is None else _strategy(n)
    params_st = nd_params(min_ndim=min_ndim, max_ndim=max_ndim, min_params=min_params, max_params=max_params,
                          max_side=max_side)

    @st.composite
    def draw_problem(draw):
        params, k = draw(params_st), draw(n_st)
        rows, extra = k * draw(st.integers(1, max_micro_rows)), draw(st.integers(0, 2))
        gen = torch.Generator().manual_seed(draw(SEEDS))
        x = {name: _nd_input(p, rows, extra, gen) for name, p in params.items()}
        return Problem(params, {}, nd_loss, {"x": x, "y": torch.randn(rows, generator=gen)}, k)

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
