"""The one-path interface (functrain/core/eager.py): each call's eager shortcut against its general path.

Each shortcut must give what the general path gives, and must switch itself off wherever
reading a value would be wrong (a trace would bake it in, a dispatch mode watches the ops).
The references are computed in each test: ``optree.tree_flatten``, the tensor-scalar path
forced by a pass-through dispatch mode, ``torch.where``, plain additions, ``torch.func``,
``torch.optim`` (for-loop and foreach) and ``make_fx`` / Dynamo traces.
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
from functrain.core import eager
from functrain.core.eager import TreespecCache, host_number
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


# -- TreespecCache ----------------------------------------------------------------------------------
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
def test_treespec_cache_equals_optree(trees):
    """A sequence of trees (same or different keys, key orders, non-tensor leaves, nesting)
    through one TreespecCache: each result is optree's: the same leaf objects and an equal spec
    (so unflattening restores the same dict, key order included)."""
    flat = TreespecCache()
    for keys, kinds, _ in trees:
        tree = _tree(keys, kinds, 0)
        for _ in range(2):   # the second call may take the cached path
            leaves, spec = flat(tree)
            ref_leaves, ref_spec = optree.tree_flatten(tree)
            assert spec == ref_spec
            assert len(leaves) == len(ref_leaves) and all(a is b for a, b in zip(leaves, ref_leaves))
            back = optree.tree_unflatten(spec, leaves)
            assert list(back) == list(tree)


def test_treespec_cache_respects_insertion_order_and_other_dict_types():
    import collections
    flat = TreespecCache()
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
            step = ft.ema(0.8, every=every, start_step=start, warmup=False)(ft.train_step(_loss, ft.optim.adamw(1e-2)))
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
    step = ft.ema(0.9, warmup=False)(ft.clip(1.0)(ft.accumulate(4)(ft.train_step(_loss, ft.optim.adamw(1e-2)))))
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


# -- the one-path interface: each call's shortcut against its general path --------------------------
def test_is_compiling_is_asked_in_one_place():
    """Transforms, optimizers and the stages are written once: ``torch.compiler.is_compiling`` is read in
    functrain/core/eager.py (``tracing()``) and nowhere else (the compiler's capture only sets the flag)."""
    import ast
    import pathlib

    root = pathlib.Path(ft.__file__).parent
    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            name = node.attr if isinstance(node, ast.Attribute) else node.id if isinstance(node, ast.Name) else None
            if name == "is_compiling":
                found.append(f"{path.relative_to(root)}:{node.lineno}")
    assert [f for f in found if not f.startswith("core/eager.py:")] == [], found
    assert found, "the interface itself must ask"


def _traced(fn, *args):
    """``fn(*args)`` traced by Dynamo (fullgraph) into a graph that is then run: what ``tracing()`` sees true.
    Returns the result and the graph's call targets."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    out = torch.compile(fn, backend=backend, fullgraph=True)(*args)
    return out, [str(n.target) for g in graphs for n in g.graph.nodes if n.op == "call_function"]


_vectors = st.lists(st.integers(0, 4), min_size=1, max_size=4)


@settings(max_examples=30, deadline=None)
@given(sizes=_vectors, pred=st.booleans(), lazy=st.booleans(), seed=st.integers(0, 2**16))
def test_select_on_the_host_is_torch_where(sizes, pred, lazy, seed):
    """A host bool picks exactly what ``torch.where`` on a bool tensor picks (bitwise), evaluates only the
    chosen branch when branches are functions, and never hands back an input tensor's memory."""
    gen = torch.Generator().manual_seed(seed)
    a = [torch.randn(n, generator=gen) for n in sizes]
    b = [torch.randn(n, generator=gen) for n in sizes]
    calls = []

    def branch(name, xs):
        if not lazy:
            return xs
        return lambda: calls.append(name) or [x * 1 for x in xs]

    host = eager.select(pred, branch("a", a), branch("b", b))
    device = eager.select(torch.tensor(pred), branch("a", a), branch("b", b))
    reference = [torch.where(torch.tensor(pred), x, y) for x, y in zip(a, b)]
    assert same_bits(host, reference) and same_bits(device, reference)
    if lazy:  # the host call ran one branch, the device call both
        assert calls == ["a" if pred else "b", "a", "b"]
    inputs = {x.untyped_storage().data_ptr() for x in a + b if x.numel()}
    assert not inputs & {x.untyped_storage().data_ptr() for x in host if x.numel()}
    one = eager.select(pred, a[0], b[0])  # a single tensor, too
    assert same_bits(one, reference[0]) and one is not a[0] and one is not b[0]


@settings(max_examples=20, deadline=None)
@given(n=st.integers(1, 6), sizes=_vectors, seed=st.integers(0, 2**16))
def test_sum_is_the_ordered_sum_eager_and_traced(n, sizes, seed):
    """``Sum`` gives the bits of the plain left-to-right additions, eagerly (in place after the second add)
    and traced (out of place: no in-place op in the graph); the trees added are never written."""
    gen = torch.Generator().manual_seed(seed)
    trees = [{"w": [torch.randn(k, generator=gen) for k in sizes], "b": torch.randn(2, generator=gen)}
             for _ in range(n)]
    before = optree.tree_map(torch.clone, trees)
    reference = trees[0]
    for t in trees[1:]:
        reference = optree.tree_map(lambda x, y: x + y, reference, t)

    def total(*ts):
        s = eager.Sum()
        for t in ts:
            s.add(t)
        return s.value

    assert same_bits(total(*trees), reference)
    assert same_bits(trees, before), "Sum wrote into a tree it was given"
    traced, ops = _traced(total, *trees)
    assert same_bits(traced, reference)
    assert not [op for op in ops if op.endswith("_") or "_.List" in op or "foreach_add_" in op], ops


@settings(max_examples=30, deadline=None)
@given(sizes=_vectors, s=st.floats(1e-4, 10.0), seed=st.integers(0, 2**16), owned=st.booleans())
def test_scaled_steps_with_a_number_are_torchs_ops_and_agree_with_tensors(sizes, s, seed, owned):
    """``sub_scaled`` / ``sub_scaled_ratio`` with a Python number are torch.optim's ``p.add(d, alpha=-s)`` and
    ``p.addcdiv(m, d, value=-s)`` bit for bit; with a float64 tensor scalar (the traced form) they agree to
    float32 rounding; ``owned`` writes into ``p`` (tensors the update made) and nothing else."""
    gen = torch.Generator().manual_seed(seed)
    p = [torch.randn(k, generator=gen) for k in sizes]
    d = [torch.randn(k, generator=gen) for k in sizes]
    m = [torch.randn(k, generator=gen) for k in sizes]
    den = [torch.rand(k, generator=gen) + 0.5 for k in sizes]
    st_ = torch.tensor(s, dtype=torch.float64)
    assert same_bits(list(eager.sub_scaled(p, d, s)), [x.add(y, alpha=-s) for x, y in zip(p, d)])
    want = [x.addcdiv(a, b, value=-s) for x, a, b in zip(p, m, den)]
    mine = [x.clone() for x in p]
    got = eager.sub_scaled_ratio(mine, m, den, s, owned=owned)
    assert same_bits(list(got), want)
    assert (got is mine) == owned and same_bits(mine, want if owned else p)
    for a, b in ((eager.sub_scaled(p, d, st_), eager.sub_scaled(p, d, s)),
                 (eager.sub_scaled_ratio(p, m, den, st_), want)):
        for x, y in zip(a, b):
            torch.testing.assert_close(x, y, rtol=2e-6, atol=2e-6 * s)


def test_divide_skips_only_an_eager_division_by_one():
    x = torch.tensor([3.0, 1.5])
    assert eager.divide(x, 1.0) is x and eager.divide(x, 1) is x
    assert torch.equal(eager.divide(x, 2.0), x / 2) and torch.equal(eager.divide(x, torch.tensor(1.0)), x)
    out, ops = _traced(lambda t: eager.divide(t, 1.0), x)
    assert torch.equal(out, x) and any("div" in op for op in ops)  # traced: a fresh output


def test_host_counters_become_state_tensors_and_doubles():
    like = torch.zeros((), dtype=torch.int64)
    t = eager.as_tensor(5, like)
    assert t.dtype == torch.int64 and int(t) == 5 and eager.as_tensor(like, like) is like
    assert eager.double(7) == 7 and eager.double(torch.tensor(7)).dtype == torch.float64


@settings(max_examples=15, deadline=None)
@given(sizes=_vectors, seed=st.integers(0, 2**16), unused=st.booleans())
def test_grad_with_aux_eager_is_torch_func(sizes, seed, unused):
    """The eager gradient (``torch.autograd.grad``) equals ``torch.func.grad_and_value``'s, computed here, and
    the traced one (Dynamo: ``torch.func``); an unused leaf gets zeros; the aux comes back detached."""
    gen = torch.Generator().manual_seed(seed)
    leaves = [torch.randn(k, generator=gen) for k in sizes] + [torch.randn(3, generator=gen)]
    x = torch.randn(3, generator=gen)

    def fn(ls, x):
        used = ls[:-1] if unused else ls
        obj = sum((torch.tanh(leaf) * leaf).sum() for leaf in used) + (ls[-1] * x).sum() * (not unused)
        return obj, {"n": obj * 2}

    grads, aux = eager.grad_with_aux(fn, leaves, x)
    ref, (_, ref_aux) = torch.func.grad_and_value(fn, has_aux=True)(leaves, x)
    assert same_bits(grads, list(ref)) and same_bits(aux, ref_aux) and not aux["n"].requires_grad
    (traced, traced_aux), _ = _traced(lambda ls, x: eager.grad_with_aux(fn, ls, x), leaves, x)
    for a, b in zip(traced, ref):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


TORCH_CASES = {
    "adam": (lambda lr: ft.optim.adam(lr), torch.optim.Adam, {}),
    "adam_l2": (lambda lr: ft.optim.adam(lr, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1), torch.optim.Adam,
                dict(betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1)),
    "adamw": (lambda lr: ft.optim.adamw(lr, weight_decay=0.2), torch.optim.AdamW, dict(weight_decay=0.2)),
    "sgd": (lambda lr: ft.optim.sgd(lr), torch.optim.SGD, {}),
    "sgd_momentum_wd": (lambda lr: ft.optim.sgd(lr, momentum=0.9, weight_decay=0.01), torch.optim.SGD,
                        dict(momentum=0.9, weight_decay=0.01)),
    "sgd_nesterov": (lambda lr: ft.optim.sgd(lr, momentum=0.8, nesterov=True), torch.optim.SGD,
                     dict(momentum=0.8, nesterov=True)),
    "sgd_dampening": (lambda lr: ft.optim.sgd(lr, momentum=0.9, dampening=0.3), torch.optim.SGD,
                      dict(momentum=0.9, dampening=0.3)),
}


@settings(max_examples=25, deadline=None)
@given(name=st.sampled_from(sorted(TORCH_CASES)), foreach=st.booleans(), lr=st.floats(1e-4, 0.1),
       seed=st.integers(0, 2**16))
def test_eager_updates_are_bitwise_torch_optim(name, foreach, lr, seed):
    """Eagerly (a CPU counter read on the host) every optimizer written once against the interface makes
    torch.optim's numbers, for-loop and foreach alike: the params agree bit for bit after 8 updates (SGD's
    dampened first buffer, a host select, included)."""
    ours, theirs, kwargs = TORCH_CASES[name]
    params, grads = _problem(seed)
    ps = {k: torch.nn.Parameter(v.clone()) for k, v in params.items()}
    opt_t = theirs(list(ps.values()), lr=lr, foreach=foreach, **kwargs)
    opt = ours(lr)
    p, s = params, opt.init(params)
    for g in grads:
        for k, v in ps.items():
            v.grad = g[k].clone()
        opt_t.step()
        p, s = opt.update(g, s, p)
    assert same_bits(p, {k: v.detach() for k, v in ps.items()}), (name, foreach)
