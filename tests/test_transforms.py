"""The laws of the step transforms (issue 3), as hypothesis property tests.

Every law is checked against a reference computed in the test itself: the
un-transformed step on the whole batch, torch.func.grad, torch.nn.utils.clip_grad_norm_,
or a closed form. Tolerances (see each test for the reasoning):

* fp32 laws (accumulation, streaming, item counts): rtol = atol = 1e-6. Summing
  micro-batch gradients reorders fp32 sums: a few ulps (2**-23 ~ 1.2e-7) of O(1)
  gradients, times lr <= 0.1, so ~1e-8 in the params; 1e-6 leaves margin yet
  fails for any real mistake (a wrong divisor is off by a factor, a mean of
  micro-batch token means by O(1e-2): see test_num_items_reference_discriminates).
* wrapping order, mixed_precision("no"), clip with a huge max_norm, skip_nonfinite
  vs the plain step on the finite batches: bitwise (same operations in the same order).
* bf16/fp16 vs fp32: the update's relative error (norm-wise) <= 8 * eps of the
  compute dtype (eps = 2**-7 for bf16, 2**-10 for fp16), see test_low_precision_close_to_fp32.
* compiled vs eager: allclose 1e-5 (aot_eager runs eager's kernels; inductor's
  fused fp32 kernels differ in the last bits); fp16 compute under inductor: see
  test_compiled_inductor_all_four_fp16.
"""
from __future__ import annotations

import itertools
import math
import textwrap

import optree
import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import functrain as ft
import functrain.testing as ftt

EPS = {"bf16": 2.0**-7, "fp16": 2.0**-10}  # machine epsilon of the compute dtype
OPTIMIZERS = {
    "sgd": lambda: ft.optim.sgd(0.1),
    "nesterov": lambda: ft.optim.sgd(0.05, momentum=0.9, nesterov=True),
    "adamw": lambda: ft.optim.adamw(1e-2, weight_decay=0.1),
}
optimizers = st.sampled_from(sorted(OPTIMIZERS))
FAST = settings(deadline=None, max_examples=25, suppress_health_check=[HealthCheck.too_slow])


def vec(tree) -> torch.Tensor:
    """All leaves of a tree as one float64 vector."""
    return torch.cat([x.detach().double().flatten() for x in optree.tree_leaves(tree)])


def update_of(new_params, old_params) -> torch.Tensor:
    return vec(new_params) - vec(old_params)


def train_state_parts(state):
    """What an update changes: params, optimizer state and the EMA (if any)."""
    return state.params, state.opt_state, state.slots.get("ema")


class Probe(ft.Transform):
    """Records the gradients as they are at its place in the ``transform`` stage."""

    def __init__(self, name="probe", order=1000):
        self.name, self.order = name, order

    def transform(self, ctx):
        ctx.metrics[self.name] = ctx.grads


class ScaleGrads(ft.Transform):
    """A user transform: multiply the gradients by a constant (stage ``transform``)."""

    name = "scale_grads"

    def __init__(self, factor, order=50):
        self.factor, self.order = factor, order

    def transform(self, ctx):
        ctx.grads = ft.tree.tree_scale(ctx.grads, self.factor)


class GradNoise(ft.Transform):
    """The Transform docstring's example: Gaussian gradient noise, with a count in its slot."""

    name = "grad_noise"
    order = 50

    def __init__(self, std):
        self.std = std

    def init(self, params, buffers):
        return {"count": torch.zeros((), dtype=torch.int64)}

    def transform(self, ctx):
        ctx.grads = ft.tree.tree_map(lambda g: g + self.std * torch.randn_like(g), ctx.grads)
        ctx.set_slot(self, {"count": ctx.slot(self)["count"] + 1})


def shifted(batch, i):
    """The i-th of a sequence of distinct batches made from one."""
    x, y = batch
    return x + 0.1 * i, y - 0.05 * i


def with_value(batch, value, row=0, col=0):
    x, y = batch
    x = x.clone()
    x[row % x.shape[0], col % x.shape[1]] = value
    return x, y


# -- 1. accumulate(n) == the big batch --------------------------------------------------------
@FAST
@given(problem=ftt.mlp_problems(), opt=optimizers, steps=st.integers(1, 3))
def test_accumulate_equals_big_batch(problem, opt, steps):
    base = ft.train_step(problem.loss_fn, OPTIMIZERS[opt]())
    acc = ft.accumulate(problem.n)(base)
    batch = lambda i: shifted(problem.batch, i)  # noqa: E731
    ref, ref_metrics = ftt.run_steps(base, base.init(problem.params), batch, steps)
    got, metrics = ftt.run_steps(acc, acc.init(problem.params), batch, steps)
    ftt.assert_same_state((got.params, got.opt_state), (ref.params, ref.opt_state), rtol=1e-6, atol=1e-6)
    ftt.assert_same_state(metrics[-1]["loss"], ref_metrics[-1]["loss"], rtol=1e-6, atol=1e-6, what="loss")


# -- 2. aux["num_items"]: accumulate(n) == the big batch's token mean -------------------------
@FAST
@given(problem=ftt.token_problems(), opt=optimizers, streaming=st.booleans())
def test_num_items_equals_token_mean(problem, opt, streaming):
    ref_step = ft.train_step(problem.mean_loss_fn, OPTIMIZERS[opt]())
    ref, ref_metrics = ftt.run_steps(ref_step, ref_step.init(problem.params), problem.batch, 2)
    step = ft.accumulate(problem.n, streaming=streaming)(ft.train_step(problem.loss_fn, OPTIMIZERS[opt]()))
    if streaming:
        micro = problem.micro_batches()
        got, metrics = ftt.run_steps(step, step.init(problem.params), lambda i: micro[i % problem.n], 2 * problem.n)
    else:
        got, metrics = ftt.run_steps(step, step.init(problem.params), problem.batch, 2)
    ftt.assert_same_state((got.params, got.opt_state), (ref.params, ref.opt_state), rtol=1e-6, atol=1e-6)
    ftt.assert_same_state(metrics[-1]["loss"], ref_metrics[-1]["loss"], rtol=1e-6, atol=1e-6, what="loss")
    assert int(metrics[-1]["num_items"]) == int(problem.batch["mask"].sum())


def test_num_items_reference_discriminates():
    """The law above can fail: a mean of per-micro-batch token means is not the token mean."""
    gen = torch.Generator().manual_seed(0)
    params = {"embed": torch.randn(5, 3, generator=gen), "head": torch.randn(3, 5, generator=gen),
              "bias": torch.zeros(5)}
    tokens = torch.randint(0, 5, (4, 6), generator=gen)
    mask = torch.arange(5)[None, :] < torch.tensor([5, 4, 1, 0])[:, None]
    problem = ftt.Problem(params, {}, ftt.token_sum_loss, {"tokens": tokens, "mask": mask}, 2, ftt.token_mean_loss)
    ref_step = ft.train_step(problem.mean_loss_fn, ft.optim.sgd(0.1))
    ref, _ = ref_step(ref_step.init(params), problem.batch)
    naive = ft.accumulate(2)(ref_step)  # each micro-batch's token mean, averaged: the short rows weigh more
    wrong, _ = naive(naive.init(params), problem.batch)
    right_step = ft.accumulate(2)(ft.train_step(problem.loss_fn, ft.optim.sgd(0.1)))
    right, _ = right_step(right_step.init(params), problem.batch)
    ftt.assert_same_state(right.params, ref.params, rtol=1e-6, atol=1e-6)
    with pytest.raises(AssertionError, match="differ"):
        ftt.assert_same_state(wrong.params, ref.params, rtol=1e-6, atol=1e-6)


# -- 3. streaming accumulation ----------------------------------------------------------------
@FAST
@given(problem=ftt.mlp_problems(n=st.integers(2, 4)), opt=optimizers, windows=st.integers(1, 2))
def test_streaming_equals_accumulate_and_big_batch(problem, opt, windows):
    n = problem.n
    base = ft.ema(0.8)(ft.train_step(problem.loss_fn, OPTIMIZERS[opt]()))
    acc = ft.accumulate(n)(base)
    stream = ft.accumulate(n, streaming=True)(base)
    ref, _ = ftt.run_steps(base, base.init(problem.params), problem.batch, windows)
    ref_acc, acc_metrics = ftt.run_steps(acc, acc.init(problem.params), problem.batch, windows)
    state = stream.init(problem.params)
    for i, micro in enumerate(problem.micro_batches() * windows):
        new, metrics = stream(state, micro)
        if (i + 1) % n:  # not the last micro-batch of a window: nothing is updated
            ftt.assert_same_state(train_state_parts(new), train_state_parts(state),
                                  what=f"params/opt/ema after non-final call {i}")
        state = new
    assert int(state.opt_state.count) == windows and int(state.slots["ema"].count) == windows
    assert int(state.slots["accumulate"]["count"]) == 0
    ftt.assert_same_state(train_state_parts(state), train_state_parts(ref_acc), rtol=1e-6, atol=1e-6,
                          what="streaming vs accumulate(n)")
    ftt.assert_same_state(train_state_parts(state), train_state_parts(ref), rtol=1e-6, atol=1e-6,
                          what="streaming vs the plain step")
    ftt.assert_same_state(metrics["loss"], acc_metrics[-1]["loss"], rtol=1e-6, atol=1e-6, what="window loss")


@settings(deadline=None, max_examples=15)
@given(problem=ftt.mlp_problems(n=st.integers(2, 3)), windows=st.lists(st.booleans(), min_size=1, max_size=4))
def test_streaming_fp16_equals_accumulate_fp16_with_overflows(problem, windows):
    """Under fp16 loss scaling, a window with an overflowing micro-batch is dropped whole and
    backs the scale off once, exactly as accumulate(n) on the window's concatenated batch."""
    n = problem.n

    def build(streaming):
        mp = ft.mixed_precision("fp16", init_scale=2.0**6, growth_interval=2)
        return ft.ema(0.9)(ft.accumulate(n, streaming=streaming)(mp(ft.train_step(problem.loss_fn, ft.optim.adamw(1e-2)))))

    stream, acc = build(True), build(False)
    s_state, a_state = stream.init(problem.params), acc.init(problem.params)
    for w, bad in enumerate(windows):
        batch = with_value(problem.batch, 1e5, w) if bad else shifted(problem.batch, w)
        a_state, a_metrics = acc(a_state, batch)
        for micro in ftt.Problem(*problem[:3], batch, n).micro_batches():
            s_state, s_metrics = stream(s_state, micro)
        assert bool(s_metrics["skipped"]) == bool(a_metrics["skipped"]) == bad
        parts = lambda s: (*train_state_parts(s), s.slots["mixed_precision"])  # noqa: E731
        ftt.assert_same_state(parts(s_state), parts(a_state), rtol=1e-6, atol=1e-6, what=f"after window {w}")


# -- 4. wrapping order does not matter -------------------------------------------------------
@settings(deadline=None, max_examples=6)
@given(problem=ftt.mlp_problems(n=2), precision=st.sampled_from(["bf16", "fp16"]), opt=optimizers)
def test_wrapping_order_does_not_matter(problem, precision, opt):
    transforms = [ft.accumulate(2), ft.mixed_precision(precision, init_scale=2.0**8, growth_interval=2),
                  ft.clip(0.3), ft.ema(0.9)]
    # step 1 overflows fp16 (exercises skip and backoff); in bf16 it is just a large input
    batch = lambda i: with_value(problem.batch, 1e5) if i == 1 and precision == "fp16" else shifted(problem.batch, i)  # noqa: E731
    base = ft.train_step(problem.loss_fn, OPTIMIZERS[opt]())
    assert ftt.assert_order_independent(base, transforms, (problem.params,), batch, steps=4) == 24


# -- 5. mixed precision ------------------------------------------------------------------------
@FAST
@given(problem=ftt.mlp_problems(), opt=optimizers, steps=st.integers(1, 3))
def test_mixed_precision_no_is_identity(problem, opt, steps):
    base = ft.train_step(problem.loss_fn, OPTIMIZERS[opt]())
    step = ft.mixed_precision("no")(base)
    batch = lambda i: shifted(problem.batch, i)  # noqa: E731
    ref, ref_metrics = ftt.run_steps(base, base.init(problem.params), batch, steps)
    got, metrics = ftt.run_steps(step, step.init(problem.params), batch, steps)
    ftt.assert_same_state(got._replace(slots={}), ref._replace(slots={}))
    ftt.assert_same_state(metrics, ref_metrics, what="metrics")


@settings(deadline=None, max_examples=40)
@given(problem=ftt.mlp_problems(n=1, min_width=4), precision=st.sampled_from(["bf16", "fp16"]))
def test_low_precision_close_to_fp32(problem, precision):
    """One SGD update in bf16/fp16 compute is within 8 eps (norm-wise, relative) of fp32's.

    The gradient goes through ~2 * depth + 3 roundings to the compute dtype (the
    casts of x, params and y, each matmul output, tanh, the residual), each of
    relative size <= eps / 2, so a few eps is expected: over 4000 random problems
    the worst was 4.6 eps (bf16) and 2.6 eps (fp16). "Well-scaled" means what that
    count assumes, no cancellation: every layer at least 4 wide (a single unit
    whose pre-activation cancels, or a 1-weight model near a stationary point,
    reaches 11-14 eps) and a residual that is not ~0 (fp32 loss >= 0.05; out - y
    cancels otherwise). A real mistake is far off: a gradient left scaled is 2**8
    off, a dropped cast gives bitwise fp32 (checked too)."""
    base = ft.train_step(problem.loss_fn, ft.optim.sgd(0.1))
    s32, m32 = base(base.init(problem.params), problem.batch)
    assume(float(m32["loss"]) >= 0.05)
    step = ft.mixed_precision(precision, init_scale=2.0**8)(base)
    s, m = step(step.init(problem.params), problem.batch)
    assert not bool(m.get("skipped", False))
    ref, got = update_of(s32.params, problem.params), update_of(s.params, problem.params)
    rel = float((got - ref).norm() / ref.norm())
    assert rel <= 8 * EPS[precision], f"{precision} update is {rel / EPS[precision]:.2f} eps from fp32's"
    assert not ft.tree.tree_equal(s.params, s32.params), f"{precision}: bitwise fp32 result (no low-precision compute?)"


@pytest.mark.parametrize("precision, dtype", [("bf16", torch.bfloat16), ("fp16", torch.float16)])
def test_mixed_precision_casts_floating_inputs(precision, dtype):
    seen = {}

    def loss_fn(params, buffers, batch):
        seen.update(w=params["w"].dtype, x=batch["x"].dtype, idx=batch["idx"].dtype)
        return (batch["x"][batch["idx"]] @ params["w"]).float().square().mean()

    step = ft.mixed_precision(precision)(ft.train_step(loss_fn, ft.optim.sgd(0.1)))
    state, _ = step(step.init({"w": torch.ones(3)}), {"x": torch.randn(4, 3), "idx": torch.tensor([0, 2])})
    assert seen == {"w": dtype, "x": dtype, "idx": torch.int64}
    assert state.params["w"].dtype == torch.float32  # master params stay fp32


@settings(deadline=None, max_examples=20)
@given(problem=ftt.mlp_problems(), bad=st.lists(st.booleans(), min_size=1, max_size=6),
       growth_interval=st.integers(2, 3), where=st.tuples(st.integers(0, 99), st.integers(0, 99)),
       value=st.sampled_from([1e5, float("inf"), float("nan")]))
def test_fp16_loss_scale_skip_backoff_growth(problem, bad, growth_interval, where, value):
    """A non-finite fp16 step (1e5 is finite in fp32 and overflows fp16) leaves params, optimizer state
    and EMA bitwise unchanged, reports skipped and halves the scale; growth_interval finite steps in a
    row double it. The reference scale is simulated by hand."""
    init = 2.0**4
    step = ft.ema(0.9)(ft.accumulate(problem.n)(ft.mixed_precision("fp16", init_scale=init, growth_interval=growth_interval)(
        ft.train_step(problem.loss_fn, ft.optim.adamw(1e-2)))))
    state = step.init(problem.params)
    scale, good, updates = init, 0, 0
    for i, is_bad in enumerate(bad):
        batch = with_value(problem.batch, value, *where) if is_bad else shifted(problem.batch, i)
        new, metrics = step(state, batch)
        assert bool(metrics["skipped"]) == is_bad
        assert float(metrics["loss_scale"]) == scale
        if is_bad:
            ftt.assert_same_state(train_state_parts(new), train_state_parts(state), what=f"skipped step {i}")
            scale, good = scale * 0.5, 0
        else:
            assert ft.tree.tree_all_finite(new.params) and not ft.tree.tree_equal(new.params, state.params)
            good, updates = good + 1, updates + 1
            if good == growth_interval:
                scale, good = scale * 2.0, 0
        assert float(new.slots["mixed_precision"].scale) == scale and int(new.slots["mixed_precision"].good_steps) == good, f"step {i}"
        assert int(new.opt_state.count) == updates and int(new.slots["ema"].count) == updates
        state = new


def test_fp16_overflow_is_finite_in_fp32():
    """The 1e5 batch above is a genuine fp16 overflow: fp32 trains on it, fp16 skips it."""
    gen = torch.Generator().manual_seed(0)
    params, batch = {"w0": torch.randn(3, 2, generator=gen), "b0": torch.zeros(2)}, (torch.randn(4, 3), torch.randn(4, 2))
    batch = with_value(batch, 1e5)
    base = ft.train_step(ftt.mlp_loss, ft.optim.sgd(1e-12))
    s32, _ = base(base.init(params), batch)
    assert ft.tree.tree_all_finite(s32.params)
    step = ft.mixed_precision("fp16")(base)
    s16, m = step(step.init(params), batch)
    assert bool(m["skipped"]) and float(s16.slots["mixed_precision"].scale) == 2.0**15
    ftt.assert_same_state(s16.params, params)


# -- 6. clipping ------------------------------------------------------------------------------
@FAST
@given(problem=ftt.mlp_problems(), frac=st.floats(0.05, 3.0))
def test_clip_norm_direction_and_grad_norm(problem, frac):
    """With g the reference gradient (torch.func.grad on the whole batch): the clipped
    gradient has norm min(|g|, max_norm) and g's direction, metrics["grad_norm"] = |g|,
    and it equals torch.nn.utils.clip_grad_norm_'s. rtol 1e-5: the clip's 1e-6 epsilon
    (as torch's) shifts the norm by 1e-6 / |g| <= 1e-5 for |g| >= 0.1 (assumed), fp32
    norms are good to ~1e-7."""
    g = torch.func.grad(problem.loss_fn)(problem.params, {}, problem.batch)
    norm = float(vec(g).norm())
    assume(norm >= 0.1)
    max_norm = frac * norm
    step = Probe()(ft.clip(max_norm)(ft.accumulate(problem.n)(ft.train_step(problem.loss_fn, ft.optim.sgd(0.1)))))
    _, metrics = step(step.init(problem.params), problem.batch)
    clipped = vec(metrics["probe"])
    assert math.isclose(float(metrics["grad_norm"]), norm, rel_tol=1e-5)
    assert math.isclose(float(clipped.norm()), min(norm, max_norm), rel_tol=1e-5)
    cosine = float(clipped @ vec(g) / (clipped.norm() * vec(g).norm()))
    assert cosine >= 1 - 1e-6
    torch_params = [torch.nn.Parameter(p.clone()) for p in optree.tree_leaves(problem.params)]
    for p, gl in zip(torch_params, optree.tree_leaves(g)):
        p.grad = gl.clone()
    torch_norm = torch.nn.utils.clip_grad_norm_(torch_params, max_norm)
    assert math.isclose(float(torch_norm), float(metrics["grad_norm"]), rel_tol=1e-5)
    # atol 1e-6 as in the accumulation law: accumulate(n) reorders the sums of O(1) terms
    ftt.assert_same_state(optree.tree_leaves(metrics["probe"]), [p.grad for p in torch_params], rtol=1e-5, atol=1e-6)


@FAST
@given(problem=ftt.mlp_problems(), opt=optimizers, steps=st.integers(1, 3))
def test_clip_huge_max_norm_is_identity(problem, opt, steps):
    base = ft.train_step(problem.loss_fn, OPTIMIZERS[opt]())
    step = ft.clip(1e30)(base)
    batch = lambda i: shifted(problem.batch, i)  # noqa: E731
    ref, ref_metrics = ftt.run_steps(base, base.init(problem.params), batch, steps)
    got, metrics = ftt.run_steps(step, step.init(problem.params), batch, steps)
    ftt.assert_same_state(got._replace(slots={}), ref._replace(slots={}))
    ftt.assert_same_state([{k: v for k, v in m.items() if k != "grad_norm"} for m in metrics], ref_metrics,
                          what="metrics")


@FAST
@given(problem=ftt.mlp_problems(n=1), frac=st.floats(0.01, 1.5), with_clip=st.booleans())
def test_clip_value_clamps(problem, frac, with_clip):
    """clip_value(v) clamps each element to [-v, v], after clip(max_norm) when both are used."""
    g = torch.func.grad(problem.loss_fn)(problem.params, {}, problem.batch)
    v = float(torch.tensor(frac * float(vec(g).abs().max()) + 1e-12))  # a float32 value: the bound is exact
    step = ft.train_step(problem.loss_fn, ft.optim.sgd(0.1))
    step = Probe()(ft.clip_value(v)(ft.clip(0.5)(step) if with_clip else step))
    _, metrics = step(step.init(problem.params), problem.batch)
    if with_clip:
        coef = min(1.0, 0.5 / (float(vec(g).norm()) + 1e-6))
        g = ft.tree.tree_map(lambda x: x * coef, g)
    expected = ft.tree.tree_map(lambda x: x.clamp(-v, v), g)
    assert float(vec(metrics["probe"]).abs().max()) <= v
    ftt.assert_same_state(metrics["probe"], expected, rtol=1e-6, atol=1e-7)


@FAST
@given(params=ftt.pytrees(), data=st.data(), frac=st.floats(0.1, 2.0))
def test_clip_and_ema_on_any_pytree(params, data, frac):
    """On params of any nesting (dicts, lists, tuples, 0-d leaves), with the linear loss
    sum(p * c) whose gradient is exactly c: the clipped gradient is c * min(1, max_norm /
    (|c| + 1e-6)) (float32 rounding of coef and product: rtol 1e-6), grad_norm = |c|, and
    the EMA after one update is (p + new) / 2 for decay 0.5."""
    coefs = optree.tree_map(lambda p: data.draw(ftt.tensors(shape=tuple(p.shape))), params)
    norm = float(vec(coefs).norm())
    assume(norm >= 0.1)

    def loss_fn(p, buffers, batch):
        return sum((x * c).sum() for x, c in zip(optree.tree_leaves(p), optree.tree_leaves(batch)))

    step = Probe()(ft.ema(0.5)(ft.clip(frac * norm)(ft.train_step(loss_fn, ft.optim.sgd(1.0)))))
    state, metrics = ftt.assert_pure(step, step.init(params), coefs)
    coef = min(1.0, frac * norm / (norm + 1e-6))
    ftt.assert_same_state(metrics["probe"], optree.tree_map(lambda c: (c.double() * coef).float(), coefs), rtol=1e-6)
    assert math.isclose(float(metrics["grad_norm"]), norm, rel_tol=1e-6)
    assert optree.tree_structure(state.params) == optree.tree_structure(params)
    half = optree.tree_map(lambda p, n: ((p.double() + n.double()) / 2).float(), params, state.params)
    ftt.assert_same_state(state.slots["ema"].params, half, rtol=1e-6, atol=1e-6)


@FAST
@given(problem=ftt.mlp_problems(), acc=st.sampled_from([None, "accumulate", "streaming"]),
       precision=st.sampled_from([None, "no", "bf16", "fp16"]), clip=st.booleans(), clip_value=st.booleans(),
       ema=st.booleans(), skip=st.booleans(), seed=st.sampled_from([None, 0, 7]))
def test_every_combination_is_pure(problem, acc, precision, clip, clip_value, ema, skip, seed):
    step = ft.train_step(problem.loss_fn, ft.optim.adamw(1e-2))
    wanted = [acc == "accumulate" and ft.accumulate(problem.n), acc == "streaming" and ft.accumulate(2, streaming=True),
              precision and ft.mixed_precision(precision), clip and ft.clip(0.5), clip_value and ft.clip_value(0.1),
              ema and ft.ema(0.9), skip and ft.skip_nonfinite(), GradNoise(1e-3) if seed is not None else None]
    for t in filter(None, wanted):
        step = t(step)
    state = step.init(problem.params, seed=seed)
    state, _ = ftt.assert_pure(step, state, problem.batch)
    ftt.assert_pure(step, state, problem.batch)  # and from a state the step made


# -- 7. EMA ----------------------------------------------------------------------------------
@FAST
@given(problem=ftt.mlp_problems(), decay=st.floats(0.05, 0.99), every=st.integers(1, 3),
       start_step=st.integers(0, 3), steps=st.integers(1, 8))
def test_ema_matches_hand_computed_average(problem, decay, every, start_step, steps):
    """Trained with AdamW, the EMA equals the average computed by hand from the sequence of params:
    copy while k <= start_step, blend on multiples of every after it, unchanged (bitwise)
    otherwise. rtol = atol = 1e-6: <= 8 fp32 lerps of O(1) values, each within an ulp (1.2e-7)."""
    step = ft.ema(decay, every=every, start_step=start_step)(ft.train_step(problem.loss_fn, ft.optim.adamw(1e-2)))
    state = step.init(problem.params)
    ref = ft.tree.tree_map(lambda p: p.double(), problem.params)
    for k in range(1, steps + 1):
        new, _ = step(state, shifted(problem.batch, k))
        if k <= start_step:
            ref = ft.tree.tree_map(lambda p: p.double(), new.params)
            ftt.assert_same_state(new.slots["ema"].params, new.params, what=f"EMA copy at update {k}")
        elif k % every == 0:
            ref = ft.tree.tree_map(lambda e, p: decay * e + (1 - decay) * p.double(), ref, new.params)
        else:
            ftt.assert_same_state(new.slots["ema"].params, state.slots["ema"].params, what=f"EMA must not change at update {k}")
        ftt.assert_same_state(ft.tree.tree_map(lambda e: e.double(), new.slots["ema"].params), ref, rtol=1e-6, atol=1e-6,
                              what=f"EMA at update {k}")
        assert int(new.slots["ema"].count) == k
        state = new


@FAST
@given(problem=ftt.mlp_problems(), decay=st.floats(0.05, 0.99), every=st.integers(1, 3), steps=st.integers(1, 10),
       seed=st.integers(0, 2**31 - 1))
def test_ema_closed_form_for_constant_params(problem, decay, every, steps, seed):
    """lr = 0 keeps the params p constant; starting the EMA from e0 != p, after m = steps // every
    blends it is decay**m * e0 + (1 - decay**m) * p. rtol 1e-5, atol 1e-6: <= 10 fp32 lerps."""
    step = ft.ema(decay, every=every)(ft.train_step(problem.loss_fn, ft.optim.sgd(0.0)))
    state = step.init(problem.params)
    gen = torch.Generator().manual_seed(seed)
    e0 = ft.tree.tree_map(lambda p: torch.randn(p.shape, generator=gen), problem.params)
    state = state.replace(slots={**state.slots, "ema": ft.EmaState(e0, state.slots["ema"].count)})
    state, _ = ftt.run_steps(step, state, problem.batch, steps)
    ftt.assert_same_state(state.params, problem.params, what="params (lr = 0)")
    m = steps // every
    expected = ft.tree.tree_map(lambda e, p: decay**m * e.double() + (1 - decay**m) * p.double(), e0, problem.params)
    ftt.assert_same_state(ft.tree.tree_map(torch.Tensor.double, state.slots["ema"].params), expected, rtol=1e-5, atol=1e-6)


# -- 8. skip_nonfinite ------------------------------------------------------------------------
@FAST
@given(problem=ftt.mlp_problems(), opt=optimizers, bad=st.lists(st.booleans(), min_size=1, max_size=6),
       value=st.sampled_from([float("inf"), float("-inf"), float("nan")]), precision=st.sampled_from(["no", "bf16"]))
def test_skip_nonfinite_skips_and_counts(problem, opt, bad, value, precision):
    """skip_nonfinite equals the plain step run on the finite batches only (bitwise), reports
    each skip and counts them."""
    base = ft.ema(0.9)(ft.mixed_precision(precision)(ft.train_step(problem.loss_fn, OPTIMIZERS[opt]())))
    step = ft.skip_nonfinite()(base)
    state, ref = step.init(problem.params), base.init(problem.params)
    for i, is_bad in enumerate(bad):
        batch = with_value(problem.batch, value, i, i) if is_bad else shifted(problem.batch, i)
        state, metrics = step(state, batch)
        if not is_bad:
            ref, _ = base(ref, batch)
        assert bool(metrics["skipped"]) == is_bad
        assert int(state.slots["skip_nonfinite"]["skipped"]) == sum(bad[: i + 1])
        ftt.assert_same_state(train_state_parts(state), train_state_parts(ref), what=f"after step {i}")


def test_skip_nonfinite_counts_dropped_updates_when_streaming():
    step = ft.skip_nonfinite()(ft.accumulate(2, streaming=True)(
        ft.train_step(lambda p, b, x: (p["w"] * x).sum(), ft.optim.sgd(0.1))))
    state = step.init({"w": torch.ones(2)})
    for x in (torch.tensor([1.0, float("inf")]), torch.tensor([1.0, 2.0])):  # one window, one dropped update
        state, _ = step(state, x)
    assert int(state.slots["skip_nonfinite"]["skipped"]) == 1


# -- 9. compiled == eager, no recompiles -------------------------------------------------------
def fixed_problem(seed=0):
    gen = torch.Generator().manual_seed(seed)
    params = {"w0": torch.randn(6, 8, generator=gen) / 6**0.5, "b0": torch.randn(8, generator=gen) * 0.1,
              "w1": torch.randn(8, 3, generator=gen) / 8**0.5, "b1": torch.zeros(3)}
    batches = [(torch.randn(8, 6, generator=gen), torch.randn(8, 3, generator=gen)) for _ in range(10)]
    return params, batches


BUILTINS = {"accumulate": lambda: ft.accumulate(2), "bf16": lambda: ft.mixed_precision("bf16"),
            "clip": lambda: ft.clip(0.5), "ema": lambda: ft.ema(0.9, every=2)}
SUBSETS = [c for r in range(5) for c in itertools.combinations(BUILTINS, r)]
EXTRA = {
    "streaming+clip+ema": [lambda: ft.accumulate(2, streaming=True), BUILTINS["clip"], BUILTINS["ema"]],
    "streaming+fp16+ema": [lambda: ft.accumulate(2, streaming=True), lambda: ft.mixed_precision(
        "fp16", init_scale=2.0**8, growth_interval=3), BUILTINS["ema"]],
    "all-four-fp16": [BUILTINS["accumulate"], lambda: ft.mixed_precision("fp16", init_scale=2.0**8, growth_interval=3),
                      BUILTINS["clip"], BUILTINS["ema"]],
    "skip_nonfinite+accumulate+bf16+ema": [ft.skip_nonfinite, BUILTINS["accumulate"], BUILTINS["bf16"], BUILTINS["ema"]],
    "clip+clip_value+scale_grads": [BUILTINS["clip"], lambda: ft.clip_value(0.05), lambda: ScaleGrads(0.5)],
}


def compile_case(makers, overflow_at=None, streaming=False):
    params, batches = fixed_problem()
    step = ft.train_step(ftt.mlp_loss, ft.optim.adamw(1e-2))
    for make in makers:
        step = make()(step)

    def batch(i):
        b = batches[i]
        if streaming:  # one micro-batch per call
            b = (b[0][:4], b[1][:4])
        return with_value(b, float("inf") if overflow_at == "inf" else 1e5) if i == 4 and overflow_at else b
    return step, step.init(params), batch


@pytest.mark.parametrize("names", SUBSETS, ids=lambda c: "+".join(c) or "plain")
def test_compiled_aot_eager_every_subset(names):
    step, state, batch = compile_case([BUILTINS[n] for n in names])
    ftt.assert_compiled_equals_eager(step, state, batch, steps=10, backend="aot_eager")


@pytest.mark.parametrize("case", sorted(EXTRA))
def test_compiled_aot_eager_extra(case):
    overflow = "1e5" if "fp16" in case else "inf" if "skip" in case else None
    step, state, batch = compile_case(EXTRA[case], overflow_at=overflow, streaming="streaming" in case)
    compiled = ftt.assert_compiled_equals_eager(step, state, batch, steps=10, backend="aot_eager")
    ftt.assert_pure(compiled, state, batch(0))


def test_compiled_inductor_streaming_clip_ema():
    step, state, batch = compile_case(EXTRA["streaming+clip+ema"], streaming=True)
    ftt.assert_compiled_equals_eager(step, state, batch, steps=10)


def test_compiled_inductor_all_four_fp16():
    """Inductor computes fp16 pointwise chains in fp32 and rounds once, eager rounds after each op:
    the fp16 gradients differ in their last bit (relative 2**-10), which no 1e-5 tolerance on
    the params can absorb. So the steps are compared one at a time (resync) with SGD, where the
    params differ by lr * |gradient difference|: atol = 8 fp16 eps * the largest update, rtol 1e-5
    for everything else; the loss and grad_norm metrics, reduced from fp16 values, to rtol = 4 eps
    (measured: 0.3 eps); the skip at step 4 and the counters (bool/int leaves) must agree exactly."""
    makers = [BUILTINS["accumulate"], lambda: ft.mixed_precision("fp16", init_scale=2.0**8, growth_interval=3),
              BUILTINS["clip"], BUILTINS["ema"]]
    params, batches = fixed_problem()
    step = ft.train_step(ftt.mlp_loss, ft.optim.sgd(0.1))
    for make in makers:
        step = make()(step)
    state = step.init(params)
    batch = lambda i: with_value(batches[i], 1e5) if i == 4 else batches[i]  # noqa: E731
    first, _ = step(state, batch(0))
    atol = 8 * EPS["fp16"] * float(update_of(first.params, params).abs().max())
    ftt.assert_compiled_equals_eager(step, state, batch, steps=10, rtol=1e-5, atol=atol, resync=True,
                                     metrics_tol=(4 * EPS["fp16"], 0.0))


def test_many_compiled_steps_coexist():
    """Nine different steps compiled in one process (more than Dynamo's recompile limit of 8 per
    code object) each compile once, and none evicts another's graph."""
    cases = [compile_case([BUILTINS[n] for n in names]) for names in SUBSETS[:9]]
    compiled = [ft.compile(step, backend="eager") for step, _, _ in cases]
    for _ in range(2):
        for c, (_, state, batch) in zip(compiled, cases):
            c(state, batch(0))
    assert [c.compiles for c in compiled] == [1] * 9


# -- 10. bad input --------------------------------------------------------------------------
def test_accumulate_indivisible_batch_names_leaf_and_n():
    params, batches = fixed_problem()
    step = ft.accumulate(3)(ft.train_step(ftt.mlp_loss, ft.optim.sgd(0.1)))
    x, y = batches[0]
    with pytest.raises(ValueError, match=r"accumulate\(3\).*'x'.*8.*divisible by 3"):
        step(step.init(params), {"x": x, "y": y})


@pytest.mark.parametrize("make, value", [
    (lambda: ft.clip(0), "0"), (lambda: ft.clip(-1.5), "-1.5"), (lambda: ft.clip_value(0.0), "0.0"),
    (lambda: ft.ema(1.5), "1.5"), (lambda: ft.ema(0.9, every=0), "0"), (lambda: ft.ema(0.9, start_step=-1), "-1"),
    (lambda: ft.mixed_precision("fp8"), "fp8"), (lambda: ft.mixed_precision("fp16", growth_interval=0), "0"),
    (lambda: ft.accumulate(0), "0"), (lambda: ft.accumulate(2.5), "2.5"),
])
def test_invalid_arguments_raise_with_value(make, value):
    with pytest.raises(ValueError) as info:
        make()
    assert value in str(info.value)


@pytest.mark.parametrize("first, second, name", [
    (lambda: ft.clip(1.0), lambda: ft.clip(2.0), "clip"),
    (lambda: ft.ema(0.9), lambda: ft.ema(0.9), "ema"),
    (lambda: ft.accumulate(2), lambda: ft.accumulate(2, streaming=True), "accumulate"),
    (lambda: ft.mixed_precision("bf16"), lambda: ft.mixed_precision("fp16"), "mixed_precision"),
    (lambda: ScaleGrads(2.0), lambda: ScaleGrads(3.0), "scale_grads"),
])
def test_same_transform_twice_raises(first, second, name):
    step = first()(ft.train_step(ftt.mlp_loss, ft.optim.sgd(0.1)))
    with pytest.raises(ValueError, match=f"'{name}'.*already applied"):
        second()(step)


# -- 11. a user transform composes with the built-ins ----------------------------------------
@FAST
@given(problem=ftt.mlp_problems(), factor=st.floats(0.1, 4.0), order=st.sampled_from([5, 50]),
       max_norm=st.floats(0.05, 2.0))
def test_custom_transform_composes_and_is_order_independent(problem, factor, order, max_norm):
    base = ft.train_step(problem.loss_fn, ft.optim.adamw(1e-2))
    batch = lambda i: shifted(problem.batch, i)  # noqa: E731
    ftt.assert_order_independent(base, [ScaleGrads(factor, order), ft.clip(max_norm)], (problem.params,), batch, 2)
    # ... and with all the built-ins (5! = 120 orders would be slow: rotate instead)
    ts = [ScaleGrads(factor, order), ft.clip(max_norm), ft.accumulate(problem.n), ft.ema(0.9),
          ft.mixed_precision("bf16")]
    states = []
    for r in range(len(ts)):
        step = base
        for t in ts[r:] + ts[:r]:
            step = t(step)
        states.append(ftt.run_steps(step, step.init(problem.params), batch, 2))
    for s in states[1:]:
        ftt.assert_same_state(s, states[0], what="rotated wrapping order")


@FAST
@given(problem=ftt.mlp_problems(n=1), factor=st.floats(0.1, 4.0))
def test_scale_grads_equals_scaled_lr(problem, factor):
    """Law of the user transform itself (and evidence its hook runs): with plain SGD, scaling the
    gradients by c equals scaling the learning rate by c (fp32 rounding: rtol 1e-6, atol 1e-7)."""
    step = ScaleGrads(factor)(ft.train_step(problem.loss_fn, ft.optim.sgd(0.1)))
    ref_step = ft.train_step(problem.loss_fn, ft.optim.sgd(0.1 * factor))
    got, _ = step(step.init(problem.params), problem.batch)
    ref, _ = ref_step(ref_step.init(problem.params), problem.batch)
    ftt.assert_same_state(got.params, ref.params, rtol=1e-6, atol=1e-7)


def test_grad_noise_is_pure_and_random():
    params, batches = fixed_problem()
    base = ft.clip(1.0)(ft.train_step(ftt.mlp_loss, ft.optim.sgd(0.1)))
    step = GradNoise(1e-2)(base)
    state = step.init(params)
    new, _ = ftt.assert_pure(step, state, batches[0])  # seeded: the same noise for the same state
    plain, _ = base(base.init(params), batches[0])
    assert not ft.tree.tree_equal(new.params, plain.params)
    again, _ = step(new, batches[0])  # the generator state advanced: different noise next step
    assert int(again.slots["grad_noise"]["count"]) == 2 and not ft.tree.tree_equal(again.rng, new.rng)
    other = step.init(params, seed=1)
    assert not ft.tree.tree_equal(step(other, batches[0])[0].params, new.params)


def test_testing_docstring_example_runs():
    namespace = {}
    exec(compile(textwrap.dedent(ftt.__doc__.rsplit("::\n", 1)[1]), "functrain.testing example", "exec"), namespace)
    namespace["test_scale_grads_laws"]()
    namespace["test_scale_grads_compiles"]()


# -- functrain.testing detects violations ---------------------------------------------------
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
