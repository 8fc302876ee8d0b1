"""clip(max_norm) and clip_value(v): the norm, the direction, torch.nn.utils.clip_grad_norm_, any pytree."""
from __future__ import annotations

import math

import optree
import pytest
import torch
from hypothesis import assume, given
from hypothesis import strategies as st

import functrain as ft
import functrain.testing as ftt
from conftest import FAST, OPTIMIZERS, optimizers, shifted, vec


@FAST
@given(problem=st.one_of(ftt.mlp_problems(), ftt.nd_problems()), frac=st.floats(0.05, 3.0))
def test_clip_norm_direction_and_grad_norm(problem, frac):
    """With g the reference gradient (torch.func.grad on the whole batch): the clipped
    gradient has norm min(|g|, max_norm) and g's direction, metrics["grad_norm"] = |g|,
    and it equals torch.nn.utils.clip_grad_norm_'s. rtol 1e-5: the clip's 1e-6 epsilon
    (as torch's) shifts the norm by 1e-6 / |g| <= 1e-5 for |g| >= 0.1 (assumed), fp32
    norms are good to ~1e-7."""
    g = torch.func.grad(problem.loss_fn)(problem.params, {}, problem.batch)
    norm = float(vec(g).norm())
    assume(norm >= 0.1)
    max_norm = frac * norm
    step, seen = ftt.probe(ft.clip(max_norm)(ft.accumulate(problem.n)(ft.train_step(problem.loss_fn, ft.optim.sgd(0.1)))))
    _, metrics = step(step.init(problem.params), problem.batch)
    clipped = vec(seen.last["grads"])
    assert math.isclose(float(metrics["grad_norm"]), norm, rel_tol=1e-5)
    assert math.isclose(float(clipped.norm()), min(norm, max_norm), rel_tol=1e-5)
    cosine = float(clipped @ vec(g) / (clipped.norm() * vec(g).norm()))
    assert cosine >= 1 - 1e-6
    torch_params = [torch.nn.Parameter(p.clone()) for p in optree.tree_leaves(problem.params)]
    for p, gl in zip(torch_params, optree.tree_leaves(g)):
        p.grad = gl.clone()
    torch_norm = torch.nn.utils.clip_grad_norm_(torch_params, max_norm)
    assert math.isclose(float(torch_norm), float(metrics["grad_norm"]), rel_tol=1e-5)
    # atol 1e-6 as in the accumulation law: accumulate(n) reorders the sums of O(1) terms
    ftt.assert_same_state(optree.tree_leaves(seen.last["grads"]), [p.grad for p in torch_params], rtol=1e-5, atol=1e-6)


@FAST
@given(problem=ftt.mlp_problems(), opt=optimizers, steps=st.integers(1, 3))
def test_clip_huge_max_norm_is_identity(problem, opt, steps):
    base = ft.train_step(problem.loss_fn, OPTIMIZERS[opt]())
    step = ft.clip(1e30)(base)
    batch = lambda i: shifted(problem.batch, i)  # noqa: E731
    ref, ref_metrics = ftt.run_steps(base, base.init(problem.params), batch, steps)
    got, metrics = ftt.run_steps(step, step.init(problem.params), batch, steps)
    ftt.assert_same_state(got._replace(slots={}), ref._replace(slots={}))
    ftt.assert_same_state([{k: v for k, v in m.items() if k != "grad_norm"} for m in metrics], ref_metrics,
                          what="metrics")


@FAST
@given(problem=ftt.mlp_problems(n=1), frac=st.floats(0.01, 1.5), with_clip=st.booleans())
def test_clip_value_clamps(problem, frac, with_clip):
    """clip_value(v) clamps each element to [-v, v], after clip(max_norm) when both are used."""
    g = torch.func.grad(problem.loss_fn)(problem.params, {}, problem.batch)
    v = float(torch.tensor(frac * float(vec(g).abs().max()) + 1e-12))  # a float32 value: the bound is exact
    step = ft.train_step(problem.loss_fn, ft.optim.sgd(0.1))
    step, seen = ftt.probe(ft.clip_value(v)(ft.clip(0.5)(step) if with_clip else step))
    step(step.init(problem.params), problem.batch)
    if with_clip:
        coef = min(1.0, 0.5 / (float(vec(g).norm()) + 1e-6))
        g = ft.tree.tree_map(lambda x: x * coef, g)
    expected = ft.tree.tree_map(lambda x: x.clamp(-v, v), g)
    assert float(vec(seen.last["grads"]).abs().max()) <= v
    ftt.assert_same_state(seen.last["grads"], expected, rtol=1e-6, atol=1e-7)


@FAST
@given(params=ftt.pytrees(), data=st.data(), frac=st.floats(0.1, 2.0))
def test_clip_and_ema_on_any_pytree(params, data, frac):
    """On params of any nesting (dicts, lists, tuples, 0-d leaves), with the linear loss
    sum(p * c) whose gradient is exactly c: the clipped gradient is c * min(1, max_norm /
    (|c| + 1e-6)) (float32 rounding of coef and product: rtol 1e-6), grad_norm = |c|, and
    the EMA after one update is (p + new) / 2 for decay 0.5."""
    coefs = optree.tree_map(lambda p: data.draw(ftt.tensors(shape=tuple(p.shape))), params)
    norm = float(vec(coefs).norm())
    assume(norm >= 0.1)

    def loss_fn(p, buffers, batch):
        return sum((x * c).sum() for x, c in zip(optree.tree_leaves(p), optree.tree_leaves(batch)))

    step, seen = ftt.probe(ft.ema(0.5, warmup=False)(ft.clip(frac * norm)(ft.train_step(loss_fn, ft.optim.sgd(1.0)))))
    state, metrics = ftt.assert_pure(step, step.init(params), coefs)
    ftt.assert_same_state(seen.records[1], seen.records[0], what="the gradient of assert_pure's second call")
    coef = min(1.0, frac * norm / (norm + 1e-6))
    ftt.assert_same_state(seen.last["grads"], optree.tree_map(lambda c: (c.double() * coef).float(), coefs), rtol=1e-6)
    assert math.isclose(float(metrics["grad_norm"]), norm, rel_tol=1e-6)
    assert optree.tree_structure(state.params) == optree.tree_structure(params)
    half = optree.tree_map(lambda p, n: ((p.double() + n.double()) / 2).float(), params, state.params)
    ftt.assert_same_state(state.slots["ema"].params, half, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("make, value", [
    (lambda: ft.clip(0), "0"), (lambda: ft.clip(-1.5), "-1.5"), (lambda: ft.clip_value(0.0), "0.0"),
])
def test_clip_invalid_arguments_raise_with_value(make, value):
    with pytest.raises(ValueError) as info:
        make()
    assert value in str(info.value)
