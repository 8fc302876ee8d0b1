"""The built-in transforms together, and with a user transform: wrapping order, purity, applied twice."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import functrain as ft
import functrain.testing as ftt
from conftest import FAST, OPTIMIZERS, GradNoise, ScaleGrads, fixed_problem, optimizers, shifted, with_value


# -- wrapping order does not matter -------------------------------------------------------
@settings(deadline=None, max_examples=6)
@given(problem=ftt.mlp_problems(n=2), precision=st.sampled_from(["bf16", "fp16"]), opt=optimizers)
def test_wrapping_order_does_not_matter(problem, precision, opt):
    transforms = [ft.accumulate(2), ft.mixed_precision(precision, init_scale=2.0**8, growth_interval=2),
                  ft.clip(0.3), ft.ema(0.9, warmup=False)]
    # step 1 overflows fp16 (exercises skip and backoff); in bf16 it is just a large input
    batch = lambda i: with_value(problem.batch, 1e5) if i == 1 and precision == "fp16" else shifted(problem.batch, i)  # noqa: E731
    base = ft.train_step(problem.loss_fn, OPTIMIZERS[opt]())
    assert ftt.assert_order_independent(base, transforms, (problem.params,), batch, steps=4) == 24


@FAST
@given(problem=ftt.mlp_problems(), acc=st.sampled_from([None, "accumulate", "streaming"]),
       precision=st.sampled_from([None, "no", "bf16", "fp16"]), clip=st.booleans(), clip_value=st.booleans(),
       ema=st.booleans(), skip=st.booleans(), seed=st.sampled_from([None, 0, 7]))
def test_every_combination_is_pure(problem, acc, precision, clip, clip_value, ema, skip, seed):
    step = ft.train_step(problem.loss_fn, ft.optim.adamw(1e-2))
    wanted = [acc == "accumulate" and ft.accumulate(problem.n), acc == "streaming" and ft.accumulate(2, streaming=True),
              precision and ft.mixed_precision(precision), clip and ft.clip(0.5), clip_value and ft.clip_value(0.1),
              ema and ft.ema(0.9, warmup=False), skip and ft.skip_nonfinite(), GradNoise(1e-3) if seed is not None else None]
    for t in filter(None, wanted):
        step = t(step)
    state = step.init(problem.params, seed=seed)
    state, _ = ftt.assert_pure(step, state, problem.batch)
    ftt.assert_pure(step, state, problem.batch)  # and from a state the step made


@pytest.mark.parametrize("first, second, name", [
    (lambda: ft.clip(1.0), lambda: ft.clip(2.0), "clip"),
    (lambda: ft.ema(0.9, warmup=False), lambda: ft.ema(0.9, warmup=False), "ema"),
    (lambda: ft.accumulate(2), lambda: ft.accumulate(2, streaming=True), "accumulate"),
    (lambda: ft.mixed_precision("bf16"), lambda: ft.mixed_precision("fp16"), "mixed_precision"),
    (lambda: ScaleGrads(2.0), lambda: ScaleGrads(3.0), "scale_grads"),
])
def test_same_transform_twice_raises(first, second, name):
    step = first()(ft.train_step(ftt.mlp_loss, ft.optim.sgd(0.1)))
    with pytest.raises(ValueError, match=f"'{name}'.*already applied"):
        second()(step)


# -- a user transform composes with the built-ins ----------------------------------------
@FAST
@given(problem=ftt.mlp_problems(), factor=st.floats(0.1, 4.0), order=st.sampled_from([5, 50]),
       max_norm=st.floats(0.05, 2.0))
def test_custom_transform_composes_and_is_order_independent(problem, factor, order, max_norm):
    base = ft.train_step(problem.loss_fn, ft.optim.adamw(1e-2))
    batch = lambda i: shifted(problem.batch, i)  # noqa: E731
    ftt.assert_order_independent(base, [ScaleGrads(factor, order), ft.clip(max_norm)], (problem.params,), batch, 2)
    # ... and with all the built-ins (5! = 120 orders would be slow: rotate instead)
    ts = [ScaleGrads(factor, order), ft.clip(max_norm), ft.accumulate(problem.n), ft.ema(0.9, warmup=False),
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
