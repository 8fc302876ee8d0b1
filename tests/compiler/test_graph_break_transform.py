"""A graph break in a transform's hook names the transform and the hook, not the loss function.

Before: ``GraphBreakError`` named the line but said "fix the loss function" whatever the line was in.
"""
import inspect

import pytest
import torch

import functrain as ft


def _line(fn, marker):
    lines, first = inspect.getsourcelines(fn)
    return first + next(i for i, text in enumerate(lines) if marker in text)


class ReadsNorm(ft.Transform):
    """Reads the gradient's norm on the host in its ``transform`` hook."""

    name = "reads_norm"
    order = 50

    def transform(self, ctx):
        norm = ft.tree.global_norm(ctx.grads).item()  # HOST-READ
        ctx.grads = ft.tree.tree_scale(ctx.grads, 1.0 / max(norm, 1.0))


class ReadsInLambda(ft.Transform):
    """Reads a value on the host in a lambda its ``check`` hook maps over the gradients."""

    name = "reads_in_lambda"
    order = 50

    def check(self, ctx):
        ctx.grads = ft.tree.tree_map(lambda g: g * float(g.sum()), ctx.grads)  # HOST-READ


class BranchInWrapper(ft.Transform):
    """Branches on a tensor in the loss wrapper its ``wrap_loss`` hook returns."""

    name = "branch_in_wrapper"
    order = 50

    def wrap_loss(self, loss_fn, ctx):
        def wrapped(params, buffers, batch):
            objective, out = loss_fn(params, buffers, batch)
            if objective > 0:  # HOST-READ
                return objective, out
            return -objective, out
        return wrapped


class CallsLoss(ft.Transform):
    """A loss wrapper that is fine itself; the loss it calls reads a value on the host."""

    name = "calls_loss"
    order = 50

    def wrap_loss(self, loss_fn, ctx):
        def wrapped(params, buffers, batch):
            return loss_fn(params, buffers, batch)
        return wrapped


def loss_fn(p, b, x):
    return (p["w"] * x).sum()


def loss_item(p, b, x):
    y = (p["w"] * x).sum()
    return y * y.item()  # HOST-READ


CASES = [
    (ReadsNorm, loss_fn, ReadsNorm.transform, "item", "the transform ReadsNorm.transform"),
    (ReadsInLambda, loss_fn, ReadsInLambda.check, "__float__", "the transform ReadsInLambda.check"),
    (BranchInWrapper, loss_fn, BranchInWrapper.wrap_loss, "__bool__", "the transform BranchInWrapper.wrap_loss"),
    (CallsLoss, loss_item, loss_item, "item", "the loss function"),
]


@pytest.mark.parametrize("transform, loss, at, what, fix", CASES, ids=[c[0].__name__ for c in CASES])
def test_a_graph_break_in_a_hook_names_the_transform_and_the_hook(transform, loss, at, what, fix):
    step = transform()(ft.train_step(loss, ft.optim.sgd(0.1)))
    state, x = step.init({"w": torch.ones(4)}), torch.tensor([1.0, -2.0, 3.0, 0.5])
    with pytest.raises(ft.GraphBreakError) as e:
        ft.compile(step, background=False)(state, x)
    assert e.value.what == what
    assert e.value.where.file == __file__ and e.value.where.line == _line(at, "# HOST-READ")
    assert f"; fix {fix}, or pass fullgraph=False" in str(e.value)
    assert e.value.where.hook == (None if fix == "the loss function" else fix.split()[-1])
