"""The capture's owned small views (functrain.compiler.rewrites.own_small_views, issue 40): a small graph output that
is a view gets its own storage (a clone as the graph returns it), so AOTAutograd does not replay the view on every
call; the values are the same bit for bit, writes to the view's base included; an input returned as it is and a
large view are left alone."""
from __future__ import annotations

import optree
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.fx.experimental.proxy_tensor import make_fx

import functrain as ft
import functrain.testing as ftt
from functrain.compiler import capture
from functrain.compiler.rewrites import OWN_VIEW_LIMIT, _is_view, own_small_views

CLONE = torch.ops.aten.clone.default


def _outputs(gm):
    out = next(n for n in gm.graph.nodes if n.op == "output")
    return optree.tree_leaves(list(out.args[0]), is_leaf=lambda x: isinstance(x, torch.fx.Node))


def _f(x, big):
    a = x * 2
    v = a[1]              # a view of an intermediate, written below: it must show the write
    a.add_(1)
    parts = (x + 3).unbind(0)
    return v, x[0, :2], parts[2], x, big.view(-1), big.sum()


@given(st.integers(3, 6), st.integers(2, 5))
@settings(max_examples=15, deadline=None)
def test_small_views_are_owned_with_the_same_values(rows, cols):
    """A law: the outputs after the pass equal, bit for bit, the outputs the graph gave before (a view reads its
    base as returned); exactly the small views (a view of an intermediate, of an input, an element of an unbind)
    became clones; the input returned as it is and the large view did not."""
    x = torch.randn(rows, cols)
    big = torch.randn(OWN_VIEW_LIMIT + 1)
    gm = make_fx(_f)(x, big)
    want = gm(x, big)
    views_before = [_is_view(n) for n in _outputs(gm)]
    assert views_before == [True, True, True, False, True, False]
    assert own_small_views(gm) == 3
    outs = _outputs(gm)
    assert [n.target is CLONE for n in outs] == [True, True, True, False, False, False]
    assert outs[3].op == "placeholder" and _is_view(outs[4])
    got = gm(x, big)
    for g, w in zip(got, want):
        assert torch.equal(g, w)
    assert torch.equal(got[0], (x[1] * 2 + 1))  # (the write after the view shows in it, as in eager)
    assert got[0].data_ptr() != x.data_ptr() and got[3] is x  # owned; the input itself stays that tensor
    assert own_small_views(gm) == 0  # (nothing left to own)


@given(ftt.mlp_problems(n=1))
@settings(max_examples=4, deadline=None)  # (each example compiles twice with aot_eager)
def test_compiled_metrics_and_state_are_eagers(problem):
    """Compiled with AOTAutograd (``aot_eager``), fresh and donating, on MLPs of drawn shapes whose adamw ``lr``
    metric is a view of the state's hyper tensor: the traced graph returns no small view, and the state and the
    metrics after 3 steps are eager's, bit for bit."""
    step = ft.train_step(problem.loss_fn, ft.optim.adamw(1e-2))
    state = step.init(problem.params)
    cap = capture.trace(step.apply, state._replace(rng=None), problem.batch, "fresh")
    outs = _outputs(cap.gm)
    assert not [n for n in outs if _is_view(n) and n.meta["val"].numel() <= OWN_VIEW_LIMIT], outs
    assert any(n.target is CLONE for n in outs)  # (the lr view was one: the pass ran)
    want = ftt.run_steps(step, ftt.clone_tree(state), problem.batch, steps=3)
    for donate in (False, True):
        run = ft.compile(step, backend="aot_eager").runner(donate=donate)
        ftt.assert_same_state(ftt.run_steps(run, ftt.clone_tree(state), problem.batch, steps=3), want,
                              what=f"donate={donate}")
