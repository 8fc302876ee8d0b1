"""The flat state gives each repeated block buffers of its own: identical blocks get identical layouts (issue 29).

Laws: the blocks the layout finds from the leaves' names are exactly the repeated ones (the same names, dtypes
and shapes after ``<container>.<i>.``); blocks alike sit at the same offsets of buffers of the same size; the
flat params read back bitwise as the params; a step on the block layout equals the plain step (eagerly and
compiled with ``reuse_blocks``); checkpoints stay the plain state's files, loadable into either layout. And the
reason for it: while a step with reused regions is traced, the calls of identical blocks hit torch's fake-tensor
cache (one fake run per distinct region), where one buffer per dtype missed on every call (each block's
parameters at other offsets of the buffer).
"""
from __future__ import annotations

import hypothesis.strategies as st
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings

import functrain as ft
from functrain.compiler.capture import trace
from functrain.core.flat import FlatLayout, FlatParams
from functrain.core.flat_blocks import blocks_by_name
from functrain.testing import assert_same_state, clone_tree


class Block(torch.nn.Module):
    def __init__(self, d=8):
        super().__init__()
        self.ln = torch.nn.LayerNorm(d)
        self.fc = torch.nn.Linear(d, 2 * d)
        self.out = torch.nn.Linear(2 * d, d)

    def forward(self, x):
        return x + self.out(F.gelu(self.fc(self.ln(x))))


class Net(torch.nn.Module):
    def __init__(self, depth, d=8):
        super().__init__()
        self.inp = torch.nn.Linear(4, d)
        self.blocks = torch.nn.ModuleList(Block(d) for _ in range(depth))
        self.head = torch.nn.Linear(d, 1)

    def forward(self, x, y):
        h = self.inp(x)
        for b in self.blocks:
            h = b(h)
        return F.mse_loss(self.head(h), y)


def _step(depth, seed=0):
    torch.manual_seed(seed)
    apply_fn, params, buffers = ft.functionalize(Net(depth))

    def loss_fn(p, b, batch):
        return apply_fn(p, b, *batch)

    return ft.train_step(loss_fn, ft.optim.adamw(1e-2)), params, buffers


def _batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(8, 4, generator=g)
    return x, x[:, :1] * 0.5


def _block_layout(layout, prefix):
    """``[(name after the prefix, shape, offset)]`` of a block's leaves, and the sizes of its buffers."""
    rows = [(name[len(prefix):], shape, off, k) for name, (k, shape, _, off) in zip(layout.names, layout.entries)
            if name.startswith(prefix)]
    return [r[:3] for r in rows], sorted({(layout.dtypes[r[3]], layout.numel[r[3]]) for r in rows}, key=str)


# -- the layout -------------------------------------------------------------------------------------
def test_identical_blocks_get_identical_layouts_in_buffers_of_their_own():
    _, params, _ = _step(4)
    flat = ft.flat(params, blocks=True)
    lay = flat.layout
    first = _block_layout(lay, "blocks.0.")
    assert first[0] and all(_block_layout(lay, f"blocks.{i}.") == first for i in range(1, 4))
    for i in range(4):  # each block's leaves, and only they, in a buffer of the block
        keys = {k for name, (k, *_) in zip(lay.names, lay.entries) if name.startswith(f"blocks.{i}.")}
        assert keys == {f"float32@blocks.{i}"} and first[0][0][2] == 0
    others = {k for name, (k, *_) in zip(lay.names, lay.entries) if not name.startswith("blocks.")}
    assert others == {"float32"} and lay.numel["float32"] == sum(
        params[n].numel() for n in params if not n.startswith("blocks."))
    assert all(torch.equal(flat[n], params[n]) for n in params)
    # one buffer per dtype when asked, as before
    one = ft.flat(params, blocks=False)
    assert one.layout.keys == ("float32",) and one.layout != lay and one.layout.same_params(lay)


def test_a_state_made_flat_has_block_buffers_in_params_moments_and_ema():
    step, params, buffers = _step(3)
    step = ft.ema(0.9)(step)
    state = step.init(params, buffers, flat="blocks")
    for node in (state.params, state.opt_state.exp_avg, state.slots["ema"].params):
        assert isinstance(node, FlatParams) and node.layout == state.params.layout
        assert len(node.buffers) == 4  # the rest, and one per block


_NAMES = st.sampled_from(["attn.w", "attn.b", "mlp.fc.w", "mlp.fc.b", "ln.w", "scale"])


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(_NAMES, st.sampled_from([torch.float32, torch.float64]),
                          st.lists(st.integers(1, 3), max_size=2)), min_size=1, max_size=4, unique_by=lambda t: t[0]),
       st.integers(0, 5), st.sampled_from([".", "/"]), st.booleans(), st.integers(0, 2**31 - 1))
def test_blocks_found_are_exactly_the_repeated_ones(block, depth, sep, odd, seed):
    """``depth`` blocks alike (and maybe one odd block of other shapes): the alike ones are blocks when there are
    2 or more and one of their names has a submodule; every leaf reads back bitwise; alike blocks share offsets."""
    g = torch.Generator().manual_seed(seed)
    params = {"embed.w": torch.randn(3, 2, generator=g), "head.b": torch.randn(2, generator=g, dtype=torch.float64)}
    for i in range(depth):
        for rest, dtype, shape in block:
            params[f"layers{sep}{i}{sep}{rest.replace('.', sep)}"] = torch.randn(shape, generator=g).to(dtype)
    if odd:
        params[f"layers{sep}{depth}{sep}attn{sep}w"] = torch.randn(7, generator=g)
    names = list(params)  # the reference: which leaves belong to which repeated block
    has_sub = any("." in rest for rest, _, _ in block)
    expect = {n: (n.split(sep)[0] + sep + n.split(sep)[1]) if depth >= 2 and has_sub and n.startswith("layers")
              and n.split(sep)[1] != str(depth) else "" for n in names}
    found = blocks_by_name(names, [params[n].dtype for n in names], [tuple(params[n].shape) for n in names])
    assert dict(zip(names, found)) == expect
    flat = ft.flat(params, blocks=True)
    assert all(torch.equal(flat[n], params[n]) and flat[n].dtype == params[n].dtype for n in params)
    assert ft.tree.tree_equal(ft.unflat(flat), params)
    lay = flat.layout
    layouts = [_block_layout(lay, f"layers{sep}{i}{sep}") for i in range(depth)] if expect != dict.fromkeys(names, "") else []
    assert all(x == layouts[0] for x in layouts)


def test_block_buffers_are_refused_for_a_layout_cut_over_ranks():
    _, params, _ = _step(2)
    with pytest.raises(ValueError, match="blocks=True.*world size 1.*3 ranks"):
        FlatLayout.from_params(params, world=3, rank=0, blocks=True)


# -- the same step --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def compiled():
    step, params, buffers = _step(3)
    return step, params, buffers, ft.compile(step, reuse_blocks=True)


def test_a_step_on_block_buffers_equals_the_plain_step_eager_and_compiled(compiled):
    step, params, buffers, cstep = compiled
    plain = step.init(clone_tree(params), buffers)
    eager = step.init(clone_tree(params), buffers, flat="blocks")
    state = step.init(clone_tree(params), buffers, flat="blocks")
    for i in range(4):
        plain, mp = step(plain, _batch(i))
        eager, me = step(eager, _batch(i))
        state, mc = cstep(state, _batch(i))
    assert cstep.compiles == 1 and isinstance(state.params, FlatParams) and len(state.params.buffers) == 4
    assert_same_state(eager, plain, rtol=1e-6, atol=1e-7)
    assert_same_state(state, eager, rtol=1e-5, atol=1e-6)
    assert_same_state(mc, me, rtol=1e-5, atol=1e-6)


def test_checkpoints_are_by_name_and_load_into_either_layout(tmp_path):
    step, params, buffers = _step(3)
    old, _ = step(ft.flat(step.init(clone_tree(params), buffers), blocks=False), _batch())
    new, _ = step(step.init(clone_tree(params), buffers, flat="blocks"), _batch())
    named_old, named_new = ft.load(ft.save(tmp_path / "old", old)), ft.load(ft.save(tmp_path / "new", new))
    assert sorted(named_old.params) == sorted(named_new.params) == sorted(params)
    # a checkpoint of the one-buffer layout loads into the block layout, and back
    into_new = ft.load(tmp_path / "old", step.init(clone_tree(params), buffers, flat="blocks"))
    assert into_new.params.layout == new.params.layout
    assert_same_state(into_new, old)
    into_old = ft.load(tmp_path / "new", ft.flat(step.init(clone_tree(params), buffers), blocks=False))
    assert into_old.params.layout == old.params.layout
    assert_same_state(into_old, new)


# -- why: the trace's fake-tensor cache hits on identical blocks ------------------------------------
def test_identical_blocks_hit_the_fake_tensor_cache_while_traced():
    from torch._dynamo.utils import compilation_time_metrics

    def fake_runs(state):
        # torch times each fake run of an invoke_subgraph call, i.e. each call that missed the fake-tensor cache
        before = len(compilation_time_metrics.get("invoke_subgraph_fake_tensor", []))
        cap = trace(step.apply, state, _batch(), "fresh", reuse_blocks=True)
        calls = sum(1 for n in cap.gm.graph.nodes if getattr(n.target, "__name__", "") == "invoke_subgraph")
        return len(compilation_time_metrics.get("invoke_subgraph_fake_tensor", [])) - before, calls

    step, params, buffers = _step(4)
    # the reference in the same test: one buffer per dtype, each block's parameters at other offsets: all miss
    assert fake_runs(ft.flat(step.init(clone_tree(params), buffers, seed=None), blocks=False)) == (8, 8)
    # block buffers: one fake run for the forward region and one for the backward; the other 6 calls hit
    assert fake_runs(step.init(clone_tree(params), buffers, seed=None, flat="blocks")) == (2, 8)


def test_init_names_a_bad_flat_value():
    step, params, buffers = _step(2)
    with pytest.raises(ValueError, match=r"flat must be False, True .* or 'blocks'.*got 'block'"):
        step.init(params, buffers, flat="block")
    assert isinstance(step.init(clone_tree(params), buffers, flat=True).params, FlatParams)
    assert len(step.init(clone_tree(params), buffers, flat=True).params.buffers) == 1  # one per dtype by default
