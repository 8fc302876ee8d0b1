"""The flat state (``ft.flat`` / ``step.init(..., flat=True)``): one buffer per dtype, read by name.

Laws: a flat state is a memory layout, not other math. The step on a flat state
equals the step on the plain state it stands for to float rounding (a matmul on a
view at an offset may round its last bit differently; clip's global norm sums in
another order), eagerly and compiled; checkpoints are the plain state's files
(saved by name, loadable into either form); resume is bit-exact.
"""
from __future__ import annotations

import os

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import given, settings

import functrain as ft
from functrain.core.flat import FlatLayout, FlatParams
from functrain.testing import assert_same_state, clone_tree, mlp_problems

FAST = settings(max_examples=15, deadline=None)


def _plain_mlp(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"w1": torch.randn(4, 6, generator=g), "b1": torch.randn(6, generator=g),
            "w2": torch.randn(6, 1, generator=g), "b2": torch.randn(1, generator=g)}


def _batch(n: int = 8, seed: int = 1) -> tuple:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 4, generator=g), torch.randn(n, 1, generator=g)


def _loss(p, b, batch):
    x, y = batch
    h = torch.tanh(x @ p["w1"] + p["b1"])
    return ((h @ p["w2"] + p["b2"] - y) ** 2).mean()


# -- the named view -------------------------------------------------------------------------------
def test_reads_by_name_as_views_of_one_buffer():
    params = _plain_mlp()
    flat = ft.flat(params)
    assert isinstance(flat, FlatParams) and list(flat.buffers) == ["float32"]
    buf = flat.buffers["float32"]
    assert buf.shape == (sum(v.numel() for v in params.values()),) and buf.is_contiguous()
    assert sorted(flat) == sorted(params) and len(flat) == 4 and "w1" in flat and "nope" not in flat
    for name, value in params.items():
        view = flat[name]
        assert view.shape == value.shape and torch.equal(view, value)
        assert view.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr()  # a view, not a copy
    assert {**flat}.keys() == params.keys() and torch.equal(dict(flat)["w2"], params["w2"])
    params["w1"].add_(1.0)  # ft.flat copied: the original tensors are not its storage
    assert not torch.equal(flat["w1"], params["w1"])
    with pytest.raises(KeyError):
        flat["nope"]


def test_tree_map_keeps_the_flat_form_and_mixed_dtypes_get_one_buffer_each():
    params = {"a": torch.ones(3), "h": torch.ones(2, 2, dtype=torch.float64), "z": torch.zeros(2)}
    flat = ft.flat(params)
    assert sorted(flat.buffers) == ["float32", "float64"]
    assert flat.buffers["float32"].shape == (5,) and flat.buffers["float64"].shape == (4,)
    zeros = ft.tree.tree_map(torch.zeros_like, flat)
    assert isinstance(zeros, FlatParams) and zeros.layout == flat.layout
    assert len(ft.tree.tree_leaves(flat)) == 2  # what a compiled step takes as inputs: one per dtype
    assert ft.tree.tree_structure(zeros) == ft.tree.tree_structure(flat)
    assert torch.equal(ft.unflat(flat)["h"], params["h"])


def test_nested_params_read_through_tree():
    params = {"enc": {"w": torch.ones(2, 2)}, "dec": {"w": torch.full((3,), 2.0)}}
    flat = ft.flat(params)
    tree = flat.tree()
    assert torch.equal(tree["dec"]["w"], params["dec"]["w"]) and torch.equal(tree["enc"]["w"], params["enc"]["w"])
    with pytest.raises(TypeError, match="use .tree"):
        flat["enc"]


def test_layouts_compare_by_structure_dtypes_and_shapes():
    a, b = FlatLayout.from_params(_plain_mlp(0)), FlatLayout.from_params(_plain_mlp(1))
    assert a == b and hash(a) == hash(b)
    other = _plain_mlp(0)
    other["b2"] = torch.zeros(2)
    assert FlatLayout.from_params(other) != a


def test_bad_params_are_named():
    with pytest.raises(TypeError, match="'step'.*floating"):
        ft.flat({"w": torch.ones(2), "step": torch.zeros((), dtype=torch.int64)})
    with pytest.raises(ValueError, match="empty"):
        ft.flat({})


def test_per_parameter_groups_are_refused_on_flat_params():
    step = ft.train_step(_loss, ft.optim.adamw(1e-2, weight_decay=0.1,
                                               weight_decay_mask=lambda name, p: p.ndim > 1))
    with pytest.raises(ValueError, match="weight_decay_mask.*flat"):
        step.init(_plain_mlp(), flat=True)


# -- laws: the same step on either form -----------------------------------------------------------
@FAST
@given(problem=mlp_problems(), lr=st.floats(1e-4, 1e-1), steps=st.integers(1, 3))
def test_adamw_on_a_flat_state_equals_the_plain_step(problem, lr, steps):
    params, batch = problem.params, problem.batch
    step = ft.train_step(problem.loss_fn, ft.optim.adamw(lr, weight_decay=0.01))
    plain = step.init(clone_tree(params))
    flat = step.init(clone_tree(params), flat=True)
    assert isinstance(flat.params, FlatParams) and isinstance(flat.opt_state.exp_avg, FlatParams)
    for _ in range(steps):
        plain, mp = step(plain, batch)
        flat, mf = step(flat, batch)
    # The update is the same elementwise math, but the gradient is not always the same bits: the params are
    # views at offsets of one buffer, and BLAS picks its kernel by alignment (an ulp on a matmul's gradient).
    assert_same_state(flat, plain, rtol=1e-6, atol=1e-7)
    assert_same_state(mf, mp, rtol=1e-6, atol=1e-7)


@FAST
@given(problem=mlp_problems(), max_norm=st.floats(1e-3, 2.0), k=st.sampled_from([1, 2]))
def test_clip_accumulate_ema_on_a_flat_state_equal_the_plain_step(problem, max_norm, k):
    params, batch = problem.params, problem.batch
    k = k if problem.n % k == 0 else 1
    step = ft.ema(0.9, warmup=False)(ft.clip(max_norm)(ft.accumulate(k)(ft.train_step(problem.loss_fn, ft.optim.adamw(1e-2)))))
    plain, flat = step.init(clone_tree(params)), step.init(clone_tree(params), flat=True)
    assert isinstance(flat.slots["ema"].params, FlatParams)
    for _ in range(2):
        plain, _ = step(plain, batch)
        flat, _ = step(flat, batch)
    # the global norm sums in another order over one buffer: float rounding only
    assert_same_state(flat, plain, rtol=1e-5, atol=1e-6)


def test_flat_of_a_state_flattens_params_moments_and_ema():
    step = ft.ema(0.5, warmup=False)(ft.train_step(_loss, ft.optim.adamw(1e-2)))
    plain = step.init(_plain_mlp())
    flat = ft.flat(plain)
    assert all(isinstance(t, FlatParams) for t in (flat.params, flat.opt_state.exp_avg, flat.opt_state.exp_avg_sq,
                                                   flat.slots["ema"].params))
    assert_same_state(flat, plain)
    assert ft.flat(flat).params is flat.params  # already flat: unchanged
    a, _ = step(plain, _batch())
    b, _ = step(flat, _batch())
    assert_same_state(b, a)


def test_bf16_mixed_precision_on_a_flat_state():
    step = ft.mixed_precision("bf16")(ft.train_step(_loss, ft.optim.adamw(1e-2)))
    plain, flat = step.init(_plain_mlp()), step.init(_plain_mlp(), flat=True)
    for _ in range(2):
        plain, _ = step(plain, _batch())
        flat, _ = step(flat, _batch())
    assert flat.params.buffers["float32"].dtype == torch.float32  # master params stay fp32
    assert_same_state(flat, plain)


# -- compiled ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def compiled():
    step = ft.ema(0.9, warmup=False)(ft.clip(0.5)(ft.train_step(_loss, ft.optim.adamw(1e-2))))
    return step, ft.compile(step)  # one inductor graph for the module


def test_compiled_flat_step_equals_eager_without_recompiles(compiled):
    step, cstep = compiled
    eager = step.init(_plain_mlp(), flat=True)
    state = step.init(_plain_mlp(), flat=True)
    for i in range(20):
        batch = _batch(seed=i)
        eager, me = step(eager, batch)
        state, mc = cstep(state, batch)
    assert cstep.compiles == 1
    assert isinstance(state.params, FlatParams)
    assert_same_state(state, eager, rtol=1e-5, atol=1e-6)
    assert_same_state(mc, me, rtol=1e-5, atol=1e-6)


def test_compiled_flat_step_graph_takes_one_input_per_dtype_per_tree(compiled):
    step, cstep = compiled
    state = step.init(_plain_mlp(), flat=True)
    cstep(state, _batch())  # the signature the first test captured: no new compile
    assert cstep.compiles == 1
    graph_inputs = len(cstep._own.last.signature.tensor_pos)
    plain_state = step.init(_plain_mlp())._replace(rng=None)  # the host RNG key is not a graph input
    plain = [x for x in ft.tree.tree_leaves((plain_state, _batch())) if torch.is_tensor(x)]
    # params, exp_avg, exp_avg_sq, ema: one buffer each instead of 4 leaves each
    assert graph_inputs == len(plain) - 4 * (4 - 1)


def test_flat_state_on_the_dynamo_path_equals_eager():
    # torch.compile per call (capture="dynamo", what fullgraph=False and other modes use) traces FlatParams too
    step = ft.clip(0.5)(ft.train_step(_loss, ft.optim.adamw(1e-2)))
    cstep = ft.compile(step, capture="dynamo", backend="aot_eager")
    eager = state = step.init(_plain_mlp(), flat=True)
    for i in range(3):
        eager, _ = step(eager, _batch(seed=i))
        state, _ = cstep(state, _batch(seed=i))
    assert isinstance(state.params, FlatParams) and cstep.compiles == 1
    assert_same_state(state, eager, rtol=1e-5, atol=1e-6)


def test_donated_flat_state_is_written_in_place_and_invalidated(compiled):
    step, _ = compiled
    donating = ft.compile(step, donate=True, backend="aot_eager")
    state = step.init(_plain_mlp(), flat=True)
    buf = state.params.buffers["float32"]
    ptr = buf.data_ptr()
    ref, _ = step(step.init(_plain_mlp(), flat=True), _batch())
    new, _ = donating(state, _batch())
    assert new.params.buffers["float32"].data_ptr() == ptr  # the update went into the donated buffer
    assert_same_state(new, ref, rtol=1e-5, atol=1e-6)
    with pytest.raises(Exception, match="donat"):
        donating(state, _batch())


def test_run_trains_a_flat_state(compiled):
    step, cstep = compiled
    data = [_batch(seed=i) for i in range(6)]
    ref = step.init(_plain_mlp())
    for b in data:
        ref, _ = step(ref, b)
    out = ft.run(cstep, step.init(_plain_mlp(), flat=True), data, progress=False)
    assert isinstance(out.params, FlatParams)
    assert_same_state(out, ref, rtol=1e-5, atol=1e-6)


# -- checkpoints --------------------------------------------------------------------------------
def test_checkpoint_of_a_flat_state_is_saved_by_name_and_loads_into_either_form(tmp_path):
    step = ft.ema(0.9, warmup=False)(ft.train_step(_loss, ft.optim.adamw(1e-2)))
    flat, _ = step(step.init(_plain_mlp(), flat=True), _batch())
    path = ft.save(tmp_path / "c", flat)
    named = ft.load(path)  # no template: the plain tree, by name
    assert sorted(named.params) == ["b1", "b2", "w1", "w2"] and isinstance(named.params, dict)
    assert sorted(named.opt_state.exp_avg) == ["b1", "b2", "w1", "w2"]
    into_flat = ft.load(path, step.init(_plain_mlp(seed=5), flat=True))
    assert isinstance(into_flat.params, FlatParams) and isinstance(into_flat.slots["ema"].params, FlatParams)
    assert torch.equal(into_flat.params.buffers["float32"], flat.params.buffers["float32"])
    assert_same_state(into_flat, flat)
    into_plain = ft.load(path, step.init(_plain_mlp(seed=5)))
    assert isinstance(into_plain.params, dict)
    assert_same_state(into_plain, flat)
    # and a plain checkpoint loads into a flat template
    again = ft.load(ft.save(tmp_path / "p", into_plain), step.init(_plain_mlp(seed=7), flat=True))
    assert isinstance(again.params, FlatParams)
    assert_same_state(again, flat)


def test_a_flat_template_of_other_shapes_is_refused_naming_the_leaf(tmp_path):
    step = ft.train_step(_loss, ft.optim.sgd(0.1))
    path = ft.save(tmp_path / "c", step.init(_plain_mlp(), flat=True))
    other = _plain_mlp()
    other["w2"] = torch.zeros(6, 2)
    other["b2"] = torch.zeros(2)
    with pytest.raises(ft.CheckpointError, match="w2"):
        ft.load(path, step.init(other, flat=True))


def test_resume_of_a_flat_state_is_bit_exact(tmp_path):
    step = ft.clip(1.0)(ft.train_step(_loss, ft.optim.adamw(1e-2)))
    data = [_batch(seed=i) for i in range(6)]
    through = step.init(_plain_mlp(), flat=True)
    for b in data:
        through, _ = step(through, b)
    half = step.init(_plain_mlp(), flat=True)
    for b in data[:3]:
        half, _ = step(half, b)
    resumed = ft.load(ft.save(tmp_path / "c", half), step.init(_plain_mlp(seed=3), flat=True))
    for b in data[3:]:
        resumed, _ = step(resumed, b)
    assert_same_state(resumed, through)  # bitwise
    assert isinstance(resumed.params, FlatParams)


def test_export_names_the_flat_params(tmp_path):
    pytest.importorskip("safetensors")
    from safetensors.torch import load_file
    model = torch.nn.Linear(3, 2)
    apply_fn, params, buffers = ft.functionalize(model)
    step = ft.train_step(lambda p, b, x: apply_fn(p, b, x).sum(), ft.optim.sgd(0.1))
    state = step.init(params, buffers, flat=True)
    paths = ft.export_weights(tmp_path / "w", state, module=model)
    got = load_file(paths["model"] if isinstance(paths, dict) else os.fspath(paths))
    assert sorted(got) == ["bias", "weight"] and torch.equal(got["weight"], model.weight.detach())


# -- recycled output buffers: the pure call path without fresh pages per step ------------------------
def _big_step():
    g = torch.Generator().manual_seed(0)
    params = {"w": torch.randn(256, 160, generator=g), "b": torch.randn(160, generator=g)}  # w: 160 KiB

    def loss(p, b, batch):
        x, y = batch
        return ((x @ p["w"] + p["b"] - y) ** 2).mean()

    return ft.train_step(loss, ft.optim.adamw(1e-2)), params


def _big_batch(i):
    g = torch.Generator().manual_seed(100 + i)
    return torch.randn(4, 256, generator=g), torch.randn(4, 160, generator=g)


@pytest.fixture(scope="module")
def big():
    step, params = _big_step()
    return step, params, ft.compile(step, backend="aot_eager")


def test_a_pure_loop_alternates_between_two_buffer_sets(big):
    step, params, cstep = big
    state = step.init(clone_tree(params))
    ref = step.init(clone_tree(params))
    ptrs = []
    for i in range(6):
        before = clone_tree(state)
        new, _ = cstep(state, _big_batch(i))
        assert_same_state(state, before)  # pure: the input state is not written
        state = new
        ref, _ = step(ref, _big_batch(i))
        ptrs.append(state.params["w"].data_ptr())
    assert_same_state(state, ref, rtol=1e-6, atol=1e-6)
    cap = cstep._own.last
    assert cap.recycled  # the large leaves (w and its two moments) are written into recycled buffers
    assert len(set(ptrs[2:])) == 2 and ptrs[2] == ptrs[4] and ptrs[3] == ptrs[5]


def test_a_state_or_view_the_caller_keeps_is_never_overwritten(big):
    step, params, cstep = big
    state = step.init(clone_tree(params))
    ref = step.init(clone_tree(params))
    kept, refs, views = [], [], []
    for i in range(5):
        state, _ = cstep(state, _big_batch(i))
        ref, _ = step(ref, _big_batch(i))
        if i % 2 == 0:
            kept.append(state)  # a whole state kept
            refs.append(ref)
        else:
            views.append((state.opt_state.exp_avg["w"][3:7].clone(), state.opt_state.exp_avg["w"][3:7]))
    for s, r in zip(kept, refs):
        assert_same_state(s, r, rtol=1e-6, atol=1e-6)
    for copy, view in views:  # only a view of a moment was kept: its storage is not reused
        assert torch.equal(copy, view)


def test_recycling_skips_small_leaves_and_donation(big):
    step, params, _ = big
    small = ft.compile(ft.train_step(_loss, ft.optim.sgd(0.1)), backend="aot_eager")
    small(small.init(_plain_mlp()), _batch())
    assert small._own.last.recycle == ()
    donating = ft.compile(step, donate=True, backend="aot_eager")
    donating(step.init(clone_tree(params)), _big_batch(0))
    assert donating._own.last.recycle == ()


def test_one_layout_type_for_the_flat_state_and_the_shards():
    """The flat state's layout is the sharded layout with world 1: ``ft.flat``'s buffers are ``pack``'s and
    rank 0's one shard; cut for W ranks, the shards joined are the same buffers padded with zeros (any
    dtypes, shapes, world size), and ``tree`` reads the params back from them bitwise."""
    shapes = st.lists(st.tuples(st.sampled_from([torch.float32, torch.float64, torch.bfloat16]),
                                st.lists(st.integers(0, 4), max_size=3)), min_size=1, max_size=6)

    @settings(max_examples=40, deadline=None)
    @given(shapes, st.integers(1, 5), st.integers(0, 2**31 - 1))
    def law(specs, world, seed):
        g = torch.Generator().manual_seed(seed)
        params = {f"p{i}": torch.randn(shape, generator=g).to(dtype) for i, (dtype, shape) in enumerate(specs)}
        flat = ft.flat(params)
        one = FlatLayout.from_params(params)
        assert type(flat.layout) is FlatLayout and flat.layout == one and (one.world, one.rank) == (1, 0)
        assert ft.tree.tree_equal(one.shard_of(params), flat.buffers) and ft.tree.tree_equal(one.flatten(params),
                                                                                               flat.buffers)
        cut = [FlatLayout.from_params(params, world=world, rank=r) for r in range(world)]
        assert all(lay.same_params(one) for lay in cut) and len({hash(lay) for lay in cut}) == world
        for k in one.keys:
            joined = torch.cat([lay.shard_of(params)[k] for lay in cut])
            assert torch.equal(joined[:one.numel[k]].view(torch.uint8), flat.buffers[k].view(torch.uint8))
            assert not joined[one.numel[k]:].any()
            assert torch.equal(joined, cut[0].pack(ft.tree.tree_leaves(params))[k])
        assert ft.tree.tree_equal(cut[-1].tree({k: torch.cat([lay.shard_of(params)[k] for lay in cut])
                                                for k in one.keys}), params)

    law()
