"""functrain.testing: its docstring example runs, and its checkers detect each violation they name."""
from __future__ import annotations

import textwrap

import optree
import pytest
import torch

import functrain as ft
import functrain.testing as ftt
from conftest import fixed_problem


def test_testing_docstring_example_runs():
    namespace = {}
    exec(compile(textwrap.dedent(ftt.__doc__.rsplit("::\n", 1)[1]), "functrain.testing example", "exec"), namespace)
    namespace["test_scale_grads_laws"]()
    namespace["test_scale_grads_compiles"]()


class WritesInput(ft.Transform):
    name = "writes_input"

    def after(self, ctx):
        optree.tree_leaves(ctx.state.params)[0].add_(1.0)


class DiffersWhenCompiled(ft.Transform):
    name = "differs_when_compiled"

    def transform(self, ctx):
        if torch.compiler.is_compiling():
            ctx.grads = ft.tree.tree_scale(ctx.grads, 1.01)


def test_checkers_detect_violations():
    params, batches = fixed_problem()
    base = ft.train_step(ftt.mlp_loss, ft.optim.sgd(0.1))
    with pytest.raises(AssertionError, match="input state"):
        step = WritesInput()(base)
        ftt.assert_pure(step, step.init(params), batches[0])
    # a "transform" that rebuilds the step drops the transforms applied before it
    rebuild = lambda step: ft.train_step(step.loss_fn, step.optimizer)  # noqa: E731
    with pytest.raises(AssertionError, match="wrapping order"):
        ftt.assert_order_independent(base, [ft.clip(0.1), rebuild], (params,), batches[0])
    step = DiffersWhenCompiled()(base)
    with pytest.raises(AssertionError, match="compiled vs eager state"):
        ftt.assert_compiled_equals_eager(step, step.init(params), batches[0], backend="aot_eager")
    with pytest.raises(AssertionError, match="recompiled at step 1"):  # a new batch shape
        ftt.assert_compiled_equals_eager(base, base.init(params), lambda i: (batches[i][0][: 8 - i], batches[i][1][: 8 - i]),
                                         backend="aot_eager")
