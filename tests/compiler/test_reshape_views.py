"""The capture's view-to-reshape pass (functrain.compiler.rewrites.reshape_views, issue 38): a view of a value the graph
never writes in place becomes a reshape (the same numbers, and lowerable when a backend's decomposition changes the
strides); a view whose base, or any alias of it, is written in place stays a view, so aliasing is kept."""
from __future__ import annotations

import torch
from torch.fx.experimental.proxy_tensor import make_fx

from functrain.compiler.rewrites import reshape_views

VIEW, RESHAPE = torch.ops.aten.view.default, torch.ops.aten.reshape.default


def _targets(gm):
    return [n.target for n in gm.graph.nodes if n.target in (VIEW, RESHAPE)]


def test_a_view_of_an_unwritten_value_becomes_a_reshape_with_the_same_numbers():
    def f(x):
        a = x * 2
        return a.view(-1) + 1, torch.matmul(x, x.transpose(-1, -2))  # (matmul of a batch: views of expands)

    x = torch.randn(3, 4, 4)
    gm = make_fx(f)(x)
    want = gm(x)
    assert VIEW in _targets(gm)
    assert reshape_views(gm) == len(_targets(gm)) > 0
    assert set(_targets(gm)) == {RESHAPE}
    for got, expected in zip(gm(x), want):
        assert torch.equal(got, expected)


def test_a_view_whose_base_is_written_in_place_stays_a_view():
    def f(x):
        a = x * 2
        v = a.view(-1)        # read after the write below: it must see it
        a.add_(1)
        w = (x + 1).view(-1)  # an alias of a value nothing writes
        s = a.t()
        u = s.view(-1) if s.is_contiguous() else s.reshape(-1)
        return v * 1, w, u

    x = torch.randn(4, 4)
    gm = make_fx(f)(x)
    want = gm(x)
    views = [n for n in gm.graph.nodes if n.target is VIEW]
    reshape_views(gm)
    kept = [n for n in views if n.target is VIEW]
    assert len(kept) == 1 and kept[0].args[0].target is torch.ops.aten.mul.Tensor  # a.view(-1) kept; w's rewritten
    for got, expected in zip(gm(x), want):
        assert torch.equal(got, expected)
    assert torch.equal(want[0], (x * 2 + 1).reshape(-1))  # (the kept view sees the in-place write)


def test_a_view_of_an_alias_that_is_written_stays_a_view():
    def f(x):
        a = x * 2
        b = a[1:]             # an alias of a
        b.mul_(3)             # written through the alias
        return a.view(-1) * 1

    x = torch.randn(4, 4)
    gm = make_fx(f)(x)
    want = gm(x)
    reshape_views(gm)
    assert VIEW in _targets(gm) and RESHAPE not in _targets(gm)
    assert torch.equal(gm(x), want)
