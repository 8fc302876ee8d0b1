"""functrain.testing: its docstring example runs, and its checkers detect each violation they name."""
from __future__ import annotations

import re
import textwrap

import optree
import pytest
import torch
from hypothesis import find, given, settings
from hypothesis import strategies as st

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


# -- the stage probe --------------------------------------------------------------------------------
STAGES_WITH_HOOKS = ("loss", "grad", "reduce", "check", "transform", "update", "commit", "after")


class Double(ft.Transform):
    """A user's transform at order 50 of the transform stage: twice the gradient."""
    name, order, needs = "double", 50, "elementwise"

    def transform(self, ctx):
        ctx.grads = ft.tree.tree_scale(ctx.grads, 2.0)


def _builtins(problem, precision):
    step = ft.train_step(problem.loss_fn, ft.optim.adamw(1e-2))
    for t in (ft.accumulate(problem.n), ft.clip(0.5), ft.ema(0.9, warmup=False), ft.mixed_precision(precision), Double()):
        step = t(step)
    return step


@settings(deadline=None, max_examples=15)
@given(problem=ftt.nd_problems(), stage=st.sampled_from(STAGES_WITH_HOOKS), precision=st.sampled_from(["no", "fp16"]),
       order=st.sampled_from([-1, 49, 51, 10**6]))
def test_probe_leaves_the_result_bitwise_unchanged(problem, stage, precision, order):
    """A probed step's states and metrics are bitwise the step's own, at every stage and place in it, over 2 steps,
    and the two steps take each other's states (the probe has no slot)."""
    step = _builtins(problem, precision)
    probed, seen = ftt.probe(step, stage, order=order)
    ref, ref_metrics = ftt.run_steps(step, step.init(problem.params), problem.batch, 2)
    got, metrics = ftt.run_steps(probed, probed.init(problem.params), problem.batch, 2)
    ftt.assert_same_state((got, metrics), (ref, ref_metrics), what=f"probed at {stage} vs unprobed")
    # once per micro-batch where the hook is called per micro-batch: the loss, and the gradient inside accumulate (0)
    per_micro = stage == "loss" or (stage == "grad" and order > 0)
    assert len(seen.records) == 2 * (problem.n if per_micro else 1)
    step.check_state(got)
    probed.check_state(ref)


@settings(deadline=None, max_examples=15)
@given(problem=ftt.mlp_problems())
def test_probe_reads_what_a_transform_gets_and_leaves(problem):
    """At order 49 the probe reads what Double (order 50) gets: the normalised gradient of the whole batch (the
    reference: torch.func.grad of the mean loss, 1e-6 as the accumulation law); at 51 what it leaves (bitwise twice
    that); at the update stage the optimizer's input (that again) and the update it makes (-lr * g for SGD)."""
    base = ft.accumulate(problem.n)(ft.train_step(problem.loss_fn, ft.optim.sgd(0.1)))
    before, after = ftt.probe(stage="transform", order=49, name="before"), ftt.probe(stage="transform", order=51, name="after")
    update = ftt.probe(stage="update")
    step = update(after(Double()(before(base))))
    state = step.init(problem.params)
    new, _ = step(state, problem.batch)
    g = torch.func.grad(problem.loss_fn)(problem.params, {}, problem.batch)
    ftt.assert_same_state(before.last["grads"], g, rtol=1e-6, atol=1e-6, what="the gradient Double gets")
    ftt.assert_same_state(after.last["grads"], ft.tree.tree_scale(before.last["grads"], 2.0), what="what it leaves")
    ftt.assert_same_state(update.last["grads"], after.last["grads"], what="the optimizer's input")
    ftt.assert_same_state(update.last["updates"], ft.tree.tree_map(lambda a, b: a - b, new.params, problem.params),
                          what="the update")
    ftt.assert_same_state(update.last["new_params"], new.params, what="the new params")
    assert int(before.last["step"]) == 0 and int(update.last["new_opt_state"].count) == 1
    assert all(x.device.type == "cpu" for x in ft.tree.tree_leaves(before.records))


def test_probe_records_host_copies_that_later_steps_do_not_change():
    params, batches = fixed_problem()
    probed, seen = ftt.probe(ft.train_step(ftt.mlp_loss, ft.optim.sgd(0.1)), "after", fields="params")
    state = probed.init(params)
    state, _ = probed(state, batches[0])
    first = ftt.clone_tree(seen.last["params"])
    assert all(a.data_ptr() != b.data_ptr() for a, b in zip(ft.tree.tree_leaves(first),
                                                            ft.tree.tree_leaves(state.params)))
    probed(state, batches[1])
    ftt.assert_same_state(seen.records[0]["params"], first, what="the first record after a second step")
    ftt.assert_same_state(seen.records[0]["params"], state.params, what="the first record")
    seen.clear()
    with pytest.raises(LookupError, match="recorded nothing"):
        seen.last


def test_probe_compiled_records_through_outputs_and_refuses_host_copies_by_name():
    params, batches = fixed_problem()
    step = ft.clip(0.5)(ft.train_step(ftt.mlp_loss, ft.optim.adamw(1e-2)))
    probed, seen = ftt.probe(step, "update", fields=("grads", "updates"), outputs=True)
    compiled = ftt.assert_compiled_equals_eager(probed, probed.init(params), batches[0], steps=2, backend="aot_eager")
    _, metrics = compiled(probed.init(params), batches[0])
    _, eager = probed(probed.init(params), batches[0])
    assert list(metrics) == list(eager) and seen.key in metrics and not seen.records
    ftt.assert_same_state(metrics[seen.key], eager[seen.key], rtol=1e-6, atol=1e-7)
    host, _ = ftt.probe(step, "update")
    with pytest.raises(Exception, match=r"Probe\('probe_update', stage='update'.*records host copies, which only an "
                                        r"eager call can make.*outputs=True"):
        ft.compile(host, backend="aot_eager")(host.init(params), batches[0])


def test_probe_in_a_sharded_step_records_this_ranks_flat_shard():
    """Under data_parallel(shard=...) (one process here: a shard of everything) the transform stage sees the
    gradient as one flat buffer per dtype: the probe records that, and the result is the unprobed step's."""
    params, batches = fixed_problem()
    plain, seen_plain = ftt.probe(ft.train_step(ftt.mlp_loss, ft.optim.sgd(0.1)), "transform")
    plain(plain.init(params), batches[0])
    for mode in ("optimizer", "params"):
        step = ft.data_parallel(shard=mode)(ft.train_step(ftt.mlp_loss, ft.optim.sgd(0.1)))
        probed, seen = ftt.probe(step, "transform")
        got, _ = probed(probed.init(params), batches[0])
        ref, _ = step(step.init(params), batches[0])
        ftt.assert_same_state(got, ref, what=f"probed vs unprobed, shard={mode!r}")
        (flat,) = seen.last["grads"].values()
        whole = torch.cat([g.reshape(-1) for g in optree.tree_leaves(seen_plain.last["grads"])])
        ftt.assert_same_state(flat[: whole.numel()], whole, what=f"the flat shard, shard={mode!r}")


@pytest.mark.parametrize("kwargs, message", [
    ({"stage": "normalise"}, "'normalise' has no hook"),
    ({"stage": "clip"}, "probe: stage must be one of ('loss', 'grad'"),
    ({"stage": "loss", "fields": ("grads",)}, "stage 'loss' records params, buffers, batch, loss; got field 'grads'"),
    ({"fields": ()}, "fields is empty"),
    ({"order": 1.5}, "probe: order must be an int; got 1.5"),
    ({"name": ""}, "name must be a non-empty str"),
])
def test_probe_bad_arguments_are_named(kwargs, message):
    with pytest.raises(ValueError) as info:
        ftt.probe(**kwargs)
    assert message in str(info.value)


def test_probe_is_a_transform_of_one_hook():
    from functrain.core.transform import Transform

    for stage in STAGES_WITH_HOOKS:
        p = ftt.probe(stage=stage)
        assert isinstance(p, ftt.Probe) and isinstance(p, Transform) and p.stage == stage
        hooks = [h for s, h in __import__("functrain.core.transform", fromlist=["x"]).STAGE_HOOKS
                 if h and getattr(type(p), h) is not getattr(Transform, h)]
        assert len(hooks) == 1, (stage, hooks)
    with pytest.raises(ValueError, match="already applied"):
        ftt.probe()(ftt.probe()(ft.train_step(ftt.mlp_loss, ft.optim.sgd(0.1))))


# -- a state at step t --------------------------------------------------------------------------------
@settings(deadline=None, max_examples=10)
@given(problem=ftt.mlp_problems(n=1), t=st.integers(0, 6))
def test_with_step_sets_the_counters_a_run_of_t_steps_reaches(problem, t):
    """with_step(init, t) has every counter a run of t steps has (the step, the optimizer's count, the rng key,
    the EMA's count through slots=), and the same next step when nothing else moved (lr 0 before t); a schedule
    reads the count: the lr of the step from there is the schedule's at t."""
    lr = ft.optim.schedules.join([ft.optim.schedules.constant(0.0), ft.optim.schedules.constant(0.1)], [t])
    step = ft.ema(0.5, start_step=10**6, warmup=False)(ft.train_step(problem.loss_fn, ft.optim.sgd(lr)))
    ran, _ = ftt.run_steps(step, step.init(problem.params), problem.batch, t)
    moved = ftt.state_at(step, problem.params, t, slots={"ema": lambda s, t: s._replace(count=torch.tensor(t))})
    ftt.assert_same_state(moved, ran, what=f"state_at(t={t}) vs {t} steps of lr 0")
    a, ma = step(moved, problem.batch)
    b, mb = step(ran, problem.batch)
    ftt.assert_same_state((a, ma), (b, mb), what="the step after")
    assert float(ma["lr"]) == 0.1


def test_state_at_drives_a_schedule_and_adam_bias_correction():
    params, batches = fixed_problem()
    sched = ft.optim.schedules.warmup_cosine(1e-2, warmup_steps=10, total_steps=110)
    step = ft.train_step(ftt.mlp_loss, ft.optim.adam(sched))
    state = ftt.state_at(step, params, 60)
    assert int(state.step) == int(state.opt_state.count) == 60 and state.rng["key"].tolist() == [0, 60]
    _, metrics = step(state, batches[0])
    assert float(metrics["lr"]) == pytest.approx(float(sched(60)))
    # Adam's first update is lr * sign(g) at count 0; at count 60 its bias corrections are 1 - beta**61
    fresh, _ = step(ftt.with_step(step.init(params), 0, updates=60), batches[0])
    g = torch.func.grad(ftt.mlp_loss)(params, {}, batches[0])
    m_hat = ft.tree.tree_map(lambda x: 0.1 * x / (1 - 0.9 ** 61), g)
    v_hat = ft.tree.tree_map(lambda x: 0.001 * x * x / (1 - 0.999 ** 61), g)
    expected = ft.tree.tree_map(lambda p, m, v: p - float(sched(60)) * m / (v.sqrt() + 1e-8), params, m_hat, v_hat)
    ftt.assert_same_state(fresh.params, expected, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("call, message", [
    (lambda s: ftt.with_step(s, -1), "with_step: t must be an int >= 0; got -1"),
    (lambda s: ftt.with_step(s, True), "with_step: t must be an int >= 0; got True"),
    (lambda s: ftt.with_step(s, 3, updates=-2), "updates must be an int >= 0; got -2"),
    (lambda s: ftt.with_step(s, 3, slots={"ema": lambda slot, t: slot}), "slots names 'ema', which this state does not"),
    (lambda s: ftt.with_step(s, 3, slots={"accumulate": 1}), "slots['accumulate'] must be callable(slot, t)"),
    (lambda s: ftt.with_step(dict(s._asdict()), 3), "with_step: state must be a TrainState"),
])
def test_with_step_bad_arguments_are_named(call, message):
    step = ft.accumulate(2, streaming=True)(ft.train_step(ftt.mlp_loss, ft.optim.sgd(0.1)))
    with pytest.raises(ValueError) as info:
        call(step.init(fixed_problem()[0]))
    assert message in str(info.value)


# -- the norm-wise law of low-precision compute ----------------------------------------------------------
def test_normwise_law_is_the_documented_bound():
    """8 eps of the compute dtype, relative to the reference's (or the update's) norm over the whole tree: the
    researcher's case (one element of 256 flipped: 2/16 = 0.125 > 8 * 2**-7 = 0.0625) fails, 0.06 passes."""
    ref = {"w": torch.ones(16, 16), "b": torch.ones(0), "n": torch.tensor(3)}
    flipped = {**ref, "w": ref["w"].clone().index_put_((torch.tensor(0), torch.tensor(0)), torch.tensor(-1.0))}
    with pytest.raises(AssertionError, match=r"is 16 eps of torch.bfloat16 \(2\*\*-7\) .* above the law's 8 eps; "
                                             r"the leaves that differ most: w \(\|diff\| 2, 1/256 elements\)"):
        ftt.assert_close_normwise(flipped, ref, dtype=torch.bfloat16)
    assert ftt.assert_close_normwise(flipped, ref, dtype="bf16", multiple=16) == 16
    within = {**ref, "w": ref["w"] + 0.06}  # relative 0.06: 7.68 eps of bf16
    assert ftt.assert_close_normwise(within, ref, dtype=torch.bfloat16) == pytest.approx(7.68, rel=1e-6)
    # fp16's epsilon is 2**-10: the same relative difference is 61 of them
    with pytest.raises(AssertionError, match="above the law's 8 eps"):
        ftt.assert_close_normwise(within, ref, dtype=torch.float16)
    # origin=: relative to the update (here 0.1), not to the params' norm (16)
    start = {**ref, "w": ref["w"] - 0.1 / 16}
    moved = {**ref, "w": ref["w"] + 1e-2 / 16}  # 1e-2 off: 0.08 eps of the params, 12.8 of the update
    assert ftt.assert_close_normwise(moved, ref, dtype=torch.bfloat16) == pytest.approx(0.08, rel=1e-4)
    with pytest.raises(AssertionError, match=re.escape("is 12.8 eps of torch.bfloat16 (2**-7) times |expected - origin| = 0.1,")):
        ftt.assert_close_normwise(moved, ref, dtype=torch.bfloat16, origin=start)


@pytest.mark.parametrize("actual, message", [
    ({"w": torch.ones(3)}, "the pytree structures differ"),
    ({"w": torch.ones(3), "v": torch.ones(2), "n": torch.tensor(4)}, "leaves differ where the law asks for equality"),
    ({"w": torch.tensor([1.0, float("inf"), 1.0]), "v": torch.ones(2), "n": torch.tensor(3)}, "non-finite elements"),
    ({"w": torch.ones(4), "v": torch.ones(2), "n": torch.tensor(3)}, "w: shape (4,) vs (3,)"),
])
def test_normwise_law_demands_equality_where_it_should(actual, message):
    ref = {"w": torch.ones(3), "v": torch.ones(2), "n": torch.tensor(3)}
    with pytest.raises(AssertionError, match=re.escape(message)):
        ftt.assert_close_normwise(actual, ref, dtype=torch.bfloat16)
    nan = {"w": torch.tensor([1.0, float("nan")]), "v": torch.ones(2), "n": torch.tensor(3)}
    assert ftt.assert_close_normwise(nan, ftt.clone_tree(nan), dtype=torch.bfloat16) == 0.0


@pytest.mark.parametrize("dtype", [torch.int32, "fp8", None])
def test_normwise_law_refuses_a_dtype_it_has_no_epsilon_for(dtype):
    with pytest.raises(ValueError, match="the law's dtype must be torch.bfloat16, torch.float16"):
        ftt.assert_close_normwise(torch.ones(1), torch.ones(1), dtype=dtype)


class NudgedWhenCompiled(ft.Transform):
    """Compiled, adds ``nudge`` to every gradient element, or scales the gradient by ``scale``: a stand-in for a
    compiled kernel that rounds otherwise (nudge) and for a real compiled-only bug (scale)."""
    name, order, needs = "nudged", 50, "elementwise"

    def __init__(self, nudge=0.0, scale=1.0):
        self.nudge, self.scale = nudge, scale

    def transform(self, ctx):
        if torch.compiler.is_compiling():
            ctx.grads = ft.tree.tree_map(lambda g: g * self.scale + self.nudge, ctx.grads)


def _tiny_gradient_problem():
    """A 256-weight linear model in bf16 whose gradient has one element of about 1e-7: below bf16's last bit
    of the others, so a rounding-sized change flips its sign."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(64, 256, generator=gen)
    x[:, 0] = 0.0
    x[0, 0] = 1e-4
    params = {"w0": torch.randn(256, 1, generator=gen) / 16, "b0": torch.zeros(1)}
    return params, (x, torch.randn(64, 1, generator=gen))


def test_compiled_law_passes_a_sign_flip_that_element_wise_comparison_fails():
    """The researcher's case, made deterministic: AdamW moves an element whose bf16 gradient flips sign by 2 * lr
    (its first update is lr * g / |g|), so element-wise the states differ; the gradients are within the law."""
    params, batch = _tiny_gradient_problem()
    step = NudgedWhenCompiled(nudge=-1e-5)(ft.mixed_precision("bf16")(ft.train_step(ftt.mlp_loss, ft.optim.adamw(1e-2))))
    state = step.init(params)
    with pytest.raises(AssertionError, match="compiled vs eager state after step 0"):
        ftt.assert_compiled_equals_eager(step, state, batch, steps=1, backend="aot_eager")
    probed, seen = ftt.probe(step, "update", fields="grads")
    probed(state, batch)
    assert 0 < float(seen.last["grads"]["w0"][0, 0]) < 1e-5  # the element that the nudge flips
    compiled = ftt.assert_compiled_equals_eager(step, state, batch, steps=2, backend="aot_eager", law=torch.bfloat16)
    assert compiled.compiles == 1
    moved = (compiled(state, batch)[0].params["w0"] - step(state, batch)[0].params["w0"]).abs()
    assert float(moved[0, 0]) == pytest.approx(2 * 1e-2, rel=1e-2) and float(moved[1:].max()) < 1e-6


def test_compiled_law_catches_a_compiled_only_bug():
    params, batch = _tiny_gradient_problem()
    bug = NudgedWhenCompiled(scale=1.2)(ft.mixed_precision("bf16")(ft.train_step(ftt.mlp_loss, ft.optim.adamw(1e-2))))
    with pytest.raises(AssertionError, match=r"compiled vs eager gradient \(the optimizer's input\) after step 0: .* "
                                             r"above the law's 16 eps"):
        ftt.assert_compiled_equals_eager(bug, bug.init(params), batch, steps=1, backend="aot_eager", law="bf16")
    with pytest.raises(ValueError, match="law= compiles the step with a gradient probe itself"):
        ftt.assert_compiled_equals_eager(bug, bug.init(params), batch, law="bf16", compiled=ft.compile(bug))


# -- params of any number of dimensions ------------------------------------------------------------------
@pytest.mark.parametrize("ndim", range(5))
def test_nd_params_draw_each_number_of_dimensions(ndim):
    params = find(ftt.nd_params(), lambda p: any(t.dim() == ndim for t in p.values()))
    assert any(t.dim() == ndim for t in params.values())
    problem = find(ftt.nd_problems(min_ndim=ndim, max_ndim=ndim, min_params=2), lambda problem: True)
    assert [t.dim() for t in problem.params.values()] == [ndim, ndim]


@settings(deadline=None, max_examples=30)
@given(problem=ftt.nd_problems())
def test_nd_loss_uses_every_param_and_splits_into_micro_batches(problem):
    """Each parameter's gradient is non-zero (the loss reaches all of them: tanh of randn inputs is never flat),
    and the batch splits into the problem's n micro-batches of the same structure."""
    g = torch.func.grad(problem.loss_fn)(problem.params, {}, problem.batch)
    for name, leaf in g.items():
        assert leaf.shape == problem.params[name].shape and bool(leaf.abs().sum() > 0), name
    micro = problem.micro_batches()
    assert len(micro) == problem.n
    assert all(optree.tree_structure(m) == optree.tree_structure(problem.batch) for m in micro)


def test_nd_params_bad_ranges_are_named():
    with pytest.raises(ValueError, match="0 <= min_ndim <= max_ndim <= 4; got min_ndim=0, max_ndim=5"):
        ftt.nd_params(max_ndim=5)
    with pytest.raises(ValueError, match="got min_params=0"):
        ftt.nd_params(min_params=0)


# -- data parallel on 2 processes ----------------------------------------------------------------------
def _nd_fixed(rows=8):
    """Params of 0 to 4 dimensions (a scalar, a vector, a matrix, a 3-D tensor, a conv filter) and a batch."""
    gen = torch.Generator().manual_seed(0)
    shapes = {"s": (), "v": (3,), "m": (3, 2), "t": (2, 2, 3), "k": (2, 3, 2, 2)}
    params = {n: torch.randn(s, generator=gen) * 0.5 for n, s in shapes.items()}
    x = {"s": torch.randn(rows, generator=gen), "v": torch.randn(rows, 3, generator=gen),
         "m": torch.randn(rows, 3, generator=gen), "t": torch.randn(rows, 2, generator=gen),
         "k": torch.randn(rows, 3, 3, 3, generator=gen)}
    return params, {"x": x, "y": torch.randn(rows, generator=gen)}


def make_user_step():
    """Module level: the ranks of assert_data_parallel_equals_one_process import it by name."""
    step = ft.train_step(ftt.nd_loss, ft.optim.adamw(1e-2))
    for t in (Double(), ft.clip(0.5), ft.ema(0.9, warmup=False), ft.accumulate(2)):
        step = t(step)
    return step


class ScaleByLocalRows(ft.Transform):
    """A user's mistake: scales the gradient by the rows of the batch this process sees (8 on one process, 4 on
    each of 2): right on one process, twice too small on two."""
    name, order, needs = "scale_by_rows", 50, "elementwise"

    def transform(self, ctx):
        rows = optree.tree_leaves(ctx.batch)[0].shape[0]
        ctx.grads = ft.tree.tree_scale(ctx.grads, rows / 8)


def make_wrong_step():
    return ScaleByLocalRows()(ft.train_step(ftt.nd_loss, ft.optim.sgd(0.1)))


def test_data_parallel_checker_passes_a_right_transform_in_every_mode():
    params, batch = _nd_fixed()
    errors = ftt.assert_data_parallel_equals_one_process(make_user_step, params, batch, steps=2, timeout=240)
    assert set(errors) == {"none", "optimizer", "params"} and max(errors.values()) <= 1e-6


def test_data_parallel_checker_catches_a_transform_that_reads_the_local_batch():
    params, batch = _nd_fixed()
    with pytest.raises(AssertionError, match=r"data_parallel\(shard='none'\) on 2 processes, rank 0, vs one process: "
                                             r"the state after 1 steps: .* leaves differ"):
        ftt.assert_data_parallel_equals_one_process(make_wrong_step, params, batch, shard="none", steps=1, timeout=240)


@pytest.mark.parametrize("kwargs, message", [
    ({"make_step": lambda: make_wrong_step()}, "define it at the top level of an importable module"),
    ({"shard": "zero"}, "shard must be one of ('none', 'optimizer', 'params'); got 'zero'"),
    ({"shard": ()}, "shard names no mode"),
    ({"steps": 0}, "steps must be an int >= 1; got 0"),
    ({"nprocs": 1}, "nprocs must be an int >= 2; got 1"),
    ({"batch": _nd_fixed(rows=6)[1]}, "divide by nprocs * micro-batches = 2 * 2; step 0's batch has a leaf of shape (6,"),
    ({"make_step": ftt.mlp_problems}, "make_step(*args) must return a functrain Step"),
])
def test_data_parallel_checker_bad_arguments_are_named_before_any_process_starts(kwargs, message):
    params, batch = _nd_fixed()
    kwargs = {"make_step": make_user_step, "params": params, "batch": batch, **kwargs}
    with pytest.raises((ValueError, TypeError)) as info:
        ftt.assert_data_parallel_equals_one_process(**kwargs)
    assert message in str(info.value)
