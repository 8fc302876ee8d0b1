"""Tree utilities and the state pytree, with hypothesis-generated trees."""
import math

import optree
import pytest
import torch
from hypothesis import given, strategies as st

import functrain as ft
from functrain import tree as T

shapes = st.lists(st.integers(0, 4), min_size=0, max_size=3).map(tuple)


@st.composite
def tensor_trees(draw, depth=2):
    def leaf():
        shape = draw(shapes)
        seed = draw(st.integers(0, 2**16))
        g = torch.Generator().manual_seed(seed)
        return torch.randn(shape, generator=g)

    def node(d):
        kind = draw(st.sampled_from(["leaf", "dict", "list", "tuple"] if d > 0 else ["leaf"]))
        if kind == "leaf":
            return leaf()
        n = draw(st.integers(0, 3))
        children = [node(d - 1) for _ in range(n)]
        if kind == "dict":
            return {f"k{i}": c for i, c in enumerate(children)}
        return children if kind == "list" else tuple(children)

    return node(depth)


@given(tensor_trees())
def test_flatten_unflatten_roundtrip(tree):
    leaves, spec = optree.tree_flatten(tree)
    back = optree.tree_unflatten(spec, leaves)
    assert T.tree_equal(tree, back)


@given(tensor_trees())
def test_global_norm_matches_concatenation(tree):
    leaves = T.tree_leaves(tree)
    flat = torch.cat([x.reshape(-1) for x in leaves]) if leaves else torch.zeros(0)
    torch.testing.assert_close(T.global_norm(tree), torch.linalg.vector_norm(flat), rtol=1e-5, atol=1e-6)


@given(tensor_trees(), st.floats(-3, 3))
def test_add_scale_select(tree, factor):
    doubled = T.tree_add(tree, tree)
    scaled = T.tree_scale(tree, 2.0)
    assert T.tree_allclose(doubled, scaled, rtol=0, atol=0)
    f = T.tree_scale(tree, factor)
    for a, b in zip(T.tree_leaves(f), T.tree_leaves(tree)):
        torch.testing.assert_close(a, b * factor)
    zeros = T.tree_zeros_like(tree)
    assert T.tree_equal(T.tree_select(torch.tensor(True), tree, zeros), tree)
    assert T.tree_equal(T.tree_select(torch.tensor(False), tree, zeros), zeros)


@given(tensor_trees(), st.sampled_from([math.inf, -math.inf, math.nan]))
def test_all_finite(tree, bad):
    assert bool(T.tree_all_finite(tree))
    leaves, spec = optree.tree_flatten(tree)
    nonempty = [i for i, x in enumerate(leaves) if x.numel()]
    if nonempty:
        leaves = [x.clone() for x in leaves]
        leaves[nonempty[0]].view(-1)[0] = bad
        assert not bool(T.tree_all_finite(optree.tree_unflatten(spec, leaves)))


def test_tree_equal_is_bitwise():
    a = {"x": torch.tensor([0.0, float("nan")])}
    assert T.tree_equal(a, {"x": torch.tensor([0.0, float("nan")])})
    assert not T.tree_equal(a, {"x": torch.tensor([-0.0, float("nan")])})
    assert not T.tree_equal(a, {"y": torch.tensor([0.0, float("nan")])})
    assert not T.tree_equal(a, {"x": torch.tensor([0.0, float("nan")], dtype=torch.float64)})


def _state():
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 1))
    _, params, buffers = ft.functionalize(model)
    step = ft.ema(0.9, warmup=False)(ft.mixed_precision("fp16")(ft.train_step(lambda p, b, x: p["0.weight"].sum(),
                                                                   ft.optim.adamw(1e-3))))
    return step.init(params, buffers)


def test_state_roundtrips_through_optree():
    state = _state()
    leaves, spec = optree.tree_flatten(state)
    back = optree.tree_unflatten(spec, leaves)
    assert isinstance(back, ft.TrainState)
    assert T.tree_equal(state, back)
    assert back.ema is not None and back.loss_scale is not None
    # every leaf is a tensor: the state is data, nothing else
    assert all(torch.is_tensor(x) for x in leaves)


def test_state_is_immutable_and_replace_copies():
    state = _state()
    with pytest.raises(AttributeError):
        state.step = torch.tensor(3)
    new = state.replace(step=state.step + 1)
    assert int(new.step) == 1 and int(state.step) == 0
