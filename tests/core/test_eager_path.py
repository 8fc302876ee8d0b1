"""The eager step's shortcuts (functrain/core/eager.py): host scalars and the cached flat-dict treespec.

Each shortcut must give what the general path gives, and must switch itself off wherever
reading a value would be wrong (a trace would bake it in, a dispatch mode watches the ops).
The references are computed in each test: ``optree.tree_flatten``, the tensor-scalar path
forced by a pass-through dispatch mode, ``torch.optim`` and ``make_fx`` replays.
"""
from __future__ import annotations

import optree
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils._python_dispatch import TorchDispatchMode

import functrain as ft
from functrain.core.eager import FlatDict, host_number
from functrain.core.validate import BadValue


class PassThrough(TorchDispatchMode):
    """Runs every op unchanged: only its presence matters (the optimizers then keep tensor scalars)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def bits(tree):
    return [x.contiguous().view(torch.int32) if x.dtype == torch.float32 else x for x in optree.tree_leaves(tree)]


def same_bits(a, b) -> bool:
    la, lb = bits(a), bits(b)
    return optree.tree_structure(a) == optree.tree_structure(b) and all(torch.equal(x, y) for x, y in zip(la, lb))


# -- host_number -------------------------------------------------------------------------------
def test_host_number_reads_a_plain_host_scalar_only():
    assert host_number(torch.tensor(7)) == 7 and type(host_number(torch.tensor(7))) is int
    assert host_number(2.5) == 2.5
    assert isinstance(host_number(torch.tensor([1, 2])), torch.Tensor)   # not 0-dim
    with PassThrough():
        assert isinstance(host_number(torch.tensor(7)), torch.Tensor)     # a mode watches the ops
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        assert isinstance(host_number(torch.tensor(7)), torch.Tensor)
    seen = []
    torch.func.vmap(lambda c: seen.append(host_number(c)) or c * 1)(torch.arange(3))
    assert isinstance(seen[0], torch.Tensor)                              # batched: not readable


OPTIMIZERS = {
    "adamw": lambda: ft.optim.adamw(3e-2, weight_decay=0.1),
    "adam_l2": lambda: ft.optim.adam(3e-2, weight_decay=0.1),
    "adamw_sched": lambda: ft.optim.adamw(ft.optim.schedules.warmup_cosine(3e-2, warmup_steps=3, total_steps=20)),
    "adamw_groups": lambda: ft.optim.adamw(3e-2, weight_decay=0.1, weight_decay_mask=lambda n, p: p.dim() > 1,
                                           lr_multipliers=lambda n, p: 2.0 if n == "b" else 1.0),
    "sgd_sched": lambda: ft.optim.sgd(ft.optim.schedules.linear_warmup(0.1, 3), momentum=0.9),
    "lion_sched": lambda: ft.optim.lion(ft.optim.schedules.cosine_decay(1e-2, 20), weight_decay=0.1),
}


def _problem(seed):
    gen = torch.Generator().manual_seed(seed)
    params = {"w": torch.randn(5, 3, generator=gen), "b": torch.randn(3, generator=gen), "s": torch.randn((), generator=gen)}
    grads = [optree.tree_map(lambda p: torch.randn(p.shape, generator=gen), params) for _ in range(8)]
    return params, grads


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_eager_scalars_match_the_tensor_scalar_path(name):
    """The host path (a CPU counter read as an int) and the tensor-scalar path (forced by a dispatch
    mode) take the same steps: within 1 ulp-level rounding (atol 1e-6 on O(1) values), 8 updates."""
    params, grads = _problem(0)
    opt = OPTIMIZERS[name]()
    host_p, host_s = params, opt.init(params)
    tens_p, tens_s = params, opt.init(params)
    for g in grads:
        host_p, host_s = opt.update(g, host_s, host_p)
        with PassThrough():
            tens_p, tens_s = opt.update(g, tens_s, tens_p)
        for a, b in zip(optree.tree_leaves((host_p, host_s)), optree.tree_leaves((tens_p, tens_s))):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


@settings(max_examples=10, deadline=None)
@given(lr=st.floats(1e-4, 0.1), wd=st.sampled_from([0.0, 0.01, 0.2]), seed=st.integers(0, 2**16))
def test_eager_adamw_is_bitwise_torch_optim(lr, wd, seed):
    """Eagerly, functrain's AdamW makes torch.optim.AdamW's (for-loop) ops with its Python-float
    scalars: the params agree bit for bit after 8 updates."""
    params, grads = _problem(seed)
    ps = {k: torch.nn.Parameter(v.clone()) for k, v in params.items()}
    opt_t = torch.optim.AdamW(list(ps.values()), lr=lr, weight_decay=wd, foreach=False)
    opt = ft.optim.adamw(lr, weight_decay=wd)
    p, s = params, opt.init(params)
    for g in grads:
        for k, v in ps.items():
            v.grad = g[k].clone()
        opt_t.step()
        p, s = opt.update(g, s, p)
    assert same_bits(p, {k: v.detach() for k, v in ps.items()})


@pytest.mark.parametrize("name", ["adamw", "adamw_sched", "sgd_sched"])
def test_a_real_mode_trace_keeps_the_counter_a_graph_input(name):
    """make_fx with real tensors runs the update eagerly under a tracing mode: the counter must stay
    a tensor (not be read and baked into the graph), so a replay at another count is right."""
    params, grads = _problem(1)
    opt = OPTIMIZERS[name]()
    state = opt.init(params)
    gm = make_fx(opt.update, tracing_mode="real")(grads[0], state, params)
    later = state
    p = params
    for g in grads[:5]:
        p, later = opt.update(g, later, p)
    expected = opt.update(grads[5], later, p)
    replayed = gm(grads[5], later, p)
    for a, b in zip(optree.tree_leaves(expected), optree.tree_leaves(replayed)):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


# -- FlatDict ----------------------------------------------------------------------------------
_keys = st.lists(st.sampled_from(list("abcdefg")), min_size=0, max_size=5, unique=True)
_leaf = st.sampled_from(["tensor", "tensor", "tensor", "float", "none", "dict"])


def _tree(keys, kinds, order_seed):
    tree = {}
    for k, kind in zip(keys, kinds):
        tree[k] = {"tensor": lambda: torch.zeros(1), "float": lambda: 1.0, "none": lambda: None,
                   "dict": lambda: {"x": torch.ones(1)}}[kind]()
    return tree


@settings(max_examples=40, deadline=None)
@given(trees=st.lists(st.tuples(_keys, st.lists(_leaf, min_size=5, max_size=5), st.integers(0, 3)),
                      min_size=1, max_size=6))
def test_flatdict_equals_optree(trees):
    """A sequence of trees (same or different keys, key orders, non-tensor leaves, nesting)
    through one FlatDict: each result is optree's: the same leaf objects and an equal spec
    (so unflattening restores the same dict, key order included)."""
    flat = FlatDict()
    for keys, kinds, _ in trees:
        tree = _tree(keys, kinds, 0)
        for _ in range(2):   # the second call may take the cached path
            leaves, spec = flat(tree)
            ref_leaves, ref_spec = optree.tree_flatten(tree)
            assert spec == ref_spec
            assert len(leaves) == len(ref_leaves) and all(a is b for a, b in zip(leaves, ref_leaves))
            back = optree.tree_unflatten(spec, leaves)
            assert list(back) == list(tree)


def test_flatdict_respects_insertion_order_and_other_dict_types():
    import collections
    flat = FlatDict()
    t = torch.zeros(1)
    flat({"a": t, "b": t})
    _, spec = flat({"b": t, "a": t})                       # same keys, another order
    assert list(optree.tree_unflatten(spec, [1, 2])) == ["b", "a"]
    _, spec = flat(collections.OrderedDict(a=t, b=t))      # not a plain dict: optree decides
    assert spec == optree.tree_structure(collections.OrderedDict(a=t, b=t))


# -- the step ----------------------------------------------------------------------------------
def _loss(p, b, batch):
    x, y = batch
    return torch.nn.functional.mse_loss(torch.tanh(x @ p["w"]) @ p["v"], y)


def test_eager_ema_decides_like_the_selects():
    """ema's host-side choice (copy / blend / keep) gives the bits of its device-side selects
    (the path a dispatch mode forces), for every (every, start_step) on 6 updates."""
    gen = torch.Generator().manual_seed(0)
    params = {"w": torch.randn(4, 3, generator=gen), "v": torch.randn(3, 1, generator=gen)}
    batch = (torch.randn(8, 4, generator=gen), torch.randn(8, 1, generator=gen))
    for every in (1, 2, 3):
        for start in (0, 2):
            step = ft.ema(0.8, every=every, start_step=start)(ft.train_step(_loss, ft.optim.adamw(1e-2)))
            a = b = step.init(params)
            for _ in range(6):
                a, _ = step(a, batch)
                with PassThrough():
                    b, _ = step(b, batch)
                assert same_bits(a.slots["ema"], b.slots["ema"]), (every, start)
                # the new EMA never shares storage with the params or the previous state
                ptrs = {x.data_ptr() for x in optree.tree_leaves(a.params)}
                assert not ptrs & {x.data_ptr() for x in optree.tree_leaves(a.slots["ema"].params)}


def test_eager_step_is_pure_with_accumulate_clip_ema():
    """The eager shortcuts write only tensors the step made: the input state is bitwise unchanged."""
    gen = torch.Generator().manual_seed(1)
    params = {"w": torch.randn(4, 3, generator=gen), "v": torch.randn(3, 1, generator=gen)}
    batch = (torch.randn(8, 4, generator=gen), torch.randn(8, 1, generator=gen))
    step = ft.ema(0.9)(ft.clip(1.0)(ft.accumulate(4)(ft.train_step(_loss, ft.optim.adamw(1e-2)))))
    state = step.init(params)
    for _ in range(3):
        snapshot = optree.tree_map(lambda x: x.clone() if torch.is_tensor(x) else x, state)
        new, _ = step(state, batch)
        assert same_bits(state, snapshot)
        state = new


def test_a_loss_tuple_of_three_is_a_clear_error():
    step = ft.train_step(lambda p, b, x: ((p["w"] * x).sum(), {}, 1), ft.optim.sgd(0.1))
    with pytest.raises(BadValue, match="a tuple of 3"):
        step(step.init({"w": torch.ones(2)}), torch.ones(2))
