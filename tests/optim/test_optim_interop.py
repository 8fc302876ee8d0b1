"""Bringing your own optimizer: the Optax-style adapter, the protocol check, the docstring examples."""
from __future__ import annotations

import doctest
import importlib
import math
from typing import NamedTuple

import optree
import pytest
import torch
from test_optim import assert_tree_close, bits_equal, make_grads, make_params, run_functional, run_torch

import functrain as ft
from functrain.optim import OptaxStyleState, adamw, check_optimizer, from_optax_style, lion, sgd


def optax_style_sgd(lr, momentum):
    """SGD with momentum written as an Optax-style pair (optax.trace + scale(-lr)) on torch tensors."""

    def init(params):
        return {"trace": optree.tree_map(torch.zeros_like, params)}

    def update(updates, state, params=None):
        trace = optree.tree_map(lambda t, g: g + momentum * t, state["trace"], updates)
        return optree.tree_map(lambda t: -lr * t, trace), {"trace": trace}

    return init, update


class ScaleByRmsState(NamedTuple):
    nu: dict


def optax_style_rmsprop(lr, decay=0.99, eps=1e-8):
    """RMSprop (torch.optim.RMSprop's arithmetic) as an Optax-style pair with a NamedTuple state."""

    def init(params):
        return ScaleByRmsState(optree.tree_map(torch.zeros_like, params))

    def update(updates, state, params=None):
        nu = optree.tree_map(lambda v, g: v * decay + (1 - decay) * g * g, state.nu, updates)
        out = optree.tree_map(lambda g, v: -lr * g / (v.sqrt() + eps), updates, nu)
        return out, ScaleByRmsState(nu)

    return init, update


def test_optax_style_sgd_momentum_matches_torch_sgd():
    params = make_params(2)
    grads = make_grads(params, steps=50, seed=3)
    expected, _ = run_torch(torch.optim.SGD, dict(lr=0.05, momentum=0.9), params, grads)
    opt = from_optax_style(*optax_style_sgd(0.05, 0.9), learning_rate=0.05)
    actual, state, lrs = run_functional(opt, params, grads)
    assert isinstance(state, OptaxStyleState) and int(state.count) == 50 and state.count.dtype == torch.int64
    assert lrs == [0.05] * 50
    # torch adds lr * buf in one fused rounding, the pair returns -lr * buf first: close, not bitwise.
    assert_tree_close(actual, expected, atol=1e-5)
    # ... and the functrain port is the bitwise one.
    ported, _, _ = run_functional(sgd(0.05, momentum=0.9), params, grads)
    assert bits_equal(ported, expected)


def test_optax_style_rmsprop_matches_torch_rmsprop():
    params = make_params(4)
    grads = make_grads(params, steps=30, seed=5)
    expected, _ = run_torch(torch.optim.RMSprop, dict(lr=1e-2, alpha=0.9, eps=1e-8), params, grads)
    actual, _, lrs = run_functional(from_optax_style(*optax_style_rmsprop(1e-2, 0.9)), params, grads)
    assert all(math.isnan(x) for x in lrs)  # no learning_rate given: reported as NaN, documented
    assert_tree_close(actual, expected, atol=1e-5)


def test_optax_style_is_pure_runs_in_train_step_and_checkpoints(tmp_path):
    init, update = optax_style_sgd(0.1, 0.5)
    sched = ft.optim.schedules.linear_warmup(0.1, 2)
    opt = check_optimizer(from_optax_style(init, update, learning_rate=sched))
    params = {"w": torch.randn(3)}
    state = opt.init(params)
    g = {"w": torch.ones(3)}
    snapshot = optree.tree_map(torch.clone, (g, state, params))
    new_params, new_state = opt.update(g, state, params)
    assert bits_equal((g, state, params), snapshot) and not bits_equal(new_params, params)

    step = ft.train_step(lambda p, b, x: (p["w"] * x).sum(), opt)
    ts = step.init({"w": torch.zeros(3)})
    lrs = []
    for _ in range(3):
        ts, metrics = step(ts, torch.ones(3))
        lrs.append(float(metrics["lr"]))
    assert lrs == [0.0, 0.05, 0.1] and int(ts.opt_state.count) == 3
    ft.checkpoint.save(tmp_path / "ck", ts.opt_state)
    assert bits_equal(ft.checkpoint.load(tmp_path / "ck"), ts.opt_state)


def test_optax_style_bad_updates():
    params = {"a": torch.zeros(2), "b": torch.zeros(3)}
    state = OptaxStyleState(torch.zeros((), dtype=torch.int64), None)
    g = optree.tree_map(torch.ones_like, params)
    cases = [
        (lambda u, s, p: u, r"update must return \(updates, state\); got \{'a'"),
        (lambda u, s, p: ({"a": u["a"]}, s), r"the updates must have the structure of the params"),
        (lambda u, s, p: ({"a": u["a"], "b": u["b"].double()}, s),
         r"the update for param 'b' must be a tensor of the param's dtype and shape \(torch\.float32 \(3,\)\); "
         r"got torch\.float64 \(3,\)"),
        (lambda u, s, p: ({"a": u["a"], "b": 1.0}, s), r"update for param 'b' .* got 1\.0 \(float\)"),
    ]
    for fn, match in cases:
        with pytest.raises(TypeError, match=match):
            from_optax_style(lambda p: None, fn).update(g, state, params)
    with pytest.raises(TypeError, match=r"from_optax_style: update must be a function; got 3 \(int\)"):
        from_optax_style(lambda p: None, 3)
    with pytest.raises(ValueError, match=r"lr must be .* got -1"):
        from_optax_style(lambda p: None, lambda u, s, p: (u, s), learning_rate=-1)


# ---------------------------------------------------------------- check_optimizer


def _torch_params():
    return [torch.nn.Parameter(torch.ones(2, 2)), torch.nn.Parameter(torch.ones(2))]


class FakeGradientTransformation(NamedTuple):  # the shape of optax.GradientTransformation
    init: object
    update: object


@pytest.mark.parametrize("obj, match", [
    # a torch.optim class, not an instance (an instance is translated: tests/optim/test_optim_torch.py)
    (torch.optim.Adam, r"torch\.optim\.adam\.Adam is a torch\.optim optimizer class.*pass an instance, "
                       r"Adam\(model\.parameters\(\), \.\.\.\), and functrain translates it.*ft\.optim\.adam\(lr=\.\.\.\)"),
    (torch.optim.RMSprop, r"RMSprop is a torch\.optim optimizer class.*a functional port .*from_optax_style"),
    (FakeGradientTransformation(lambda p: None, lambda u, s, p: (u, s)),
     r"has init and update but no learning_rate: .*ft\.optim\.from_optax_style\(tx\.init, tx\.update"),
    (ft.optim.adamw, r"got the factory ft\.optim\.adamw itself; call it, e\.g\. ft\.optim\.adamw\(lr=1e-3\)"),
    (42, r"optimizer must be a functrain optimizer .*got 42 \(int\) without init, update, learning_rate: "
         r"a functrain optimizer is Optimizer\(init, update, learning_rate\)"),
    (torch.nn.Sequential(torch.nn.Linear(30, 30), torch.nn.ReLU(), torch.nn.Linear(30, 1)),
     r"(?s)got Sequential\(.{60,80}\.\.\. \(Sequential\) without"),  # long reprs are cut
])
def test_check_optimizer_explains(obj, match):
    with pytest.raises(TypeError, match=match):
        check_optimizer(obj)


def test_check_optimizer_accepts_functrain_optimizers():
    for opt in (sgd(0.1), adamw(1e-3), lion(1e-4), from_optax_style(*optax_style_sgd(0.1, 0.9)),
                ft.optim.Optimizer(lambda p: None, lambda g, s, p: (p, s), lambda s: 0.1)):
        assert check_optimizer(opt) is opt


# ---------------------------------------------------------------- docstring examples


@pytest.mark.parametrize("module", ["functrain.optim", "functrain.optim.base", "functrain.optim.adam",
                                    "functrain.optim.sgd", "functrain.optim.lion", "functrain.optim.groups", "functrain.core.optimizer",
                                    "functrain.optim.masks", "functrain.optim.schedules", "functrain.optim.interop",
                                    "functrain.optim.schedulefree", "functrain.optim.torch_optim",
                                    "functrain.optim.torch_schedules", "functrain.optim.torch_step",
                                    "functrain.optim.torch_names", "functrain.optim.partition"])
def test_docstring_examples(module):
    result = doctest.testmod(importlib.import_module(module), optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0
