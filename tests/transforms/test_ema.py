"""ema(decay, every, start_step, power, inv_gamma, min_decay, warmup=False): the hand-computed average, the closed form for
constant params, the warm-up ramp (its closed forms: the plain mean for power = 1, the ramp for constant params)."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import functrain as ft
import functrain.testing as ftt
from conftest import FAST, fixed_problem, shifted, with_value


@FAST
@given(problem=ftt.mlp_problems(), decay=st.floats(0.05, 0.99), every=st.integers(1, 3),
       start_step=st.integers(0, 3), steps=st.integers(1, 8))
def test_ema_matches_hand_computed_average(problem, decay, every, start_step, steps):
    """Trained with AdamW, the EMA equals the average computed by hand from the sequence of params:
    copy while k <= start_step, blend on multiples of every after it, unchanged (bitwise)
    otherwise. rtol = atol = 1e-6: <= 8 fp32 lerps of O(1) values, each within an ulp (1.2e-7)."""
    step = ft.ema(decay, every=every, start_step=start_step, warmup=False)(ft.train_step(problem.loss_fn, ft.optim.adamw(1e-2)))
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
    step = ft.ema(decay, every=every, warmup=False)(ft.train_step(problem.loss_fn, ft.optim.sgd(0.0)))
    state = step.init(problem.params)
    gen = torch.Generator().manual_seed(seed)
    e0 = ft.tree.tree_map(lambda p: torch.randn(p.shape, generator=gen), problem.params)
    state = state.replace(slots={**state.slots, "ema": ft.EmaState(e0, state.slots["ema"].count)})
    state, _ = ftt.run_steps(step, state, problem.batch, steps)
    ftt.assert_same_state(state.params, problem.params, what="params (lr = 0)")
    m = steps // every
    expected = ft.tree.tree_map(lambda e, p: decay**m * e.double() + (1 - decay**m) * p.double(), e0, problem.params)
    ftt.assert_same_state(ft.tree.tree_map(torch.Tensor.double, state.slots["ema"].params), expected, rtol=1e-5, atol=1e-6)


def _ramp(k, decay, start_step, power, inv_gamma, min_decay):
    """The warm-up decay at applied update k, written out (ema-pytorch's get_current_decay, in its own terms)."""
    if power is None:
        return decay
    t = k - start_step
    return min(decay, max(min_decay, 1.0 - (1.0 + t / inv_gamma) ** -power))


@FAST
@given(problem=ftt.mlp_problems(), decay=st.floats(0.5, 0.999), every=st.integers(1, 3), start_step=st.integers(0, 4),
       power=st.floats(0.25, 2.0), inv_gamma=st.floats(0.5, 8.0), min_decay=st.floats(0.0, 1.0), steps=st.integers(1, 9),
       t0=st.sampled_from([0, 0, 97, 2820]))
def test_ema_warmup_matches_hand_computed_ramp(problem, decay, every, start_step, power, inv_gamma, min_decay, steps, t0):
    """With power=, the k-th blend (k > start_step, k % every == 0) uses
    d_k = clamp(1 - (1 + (k - start_step) / inv_gamma) ** -power, min_decay, decay), computed here in float64
    from the formula; copies and unchanged updates as without the ramp. rtol = atol = 1e-6 as above (the
    decay reaches the fp32 lerp as a float32 weight: 6e-8 relative, well inside). The run starts at update t0
    (ftt.state_at, the EMA's own count moved too): late in the ramp, where it reaches decay."""
    min_decay *= decay
    ema = ft.ema(decay, every=every, start_step=start_step, power=power, inv_gamma=inv_gamma, min_decay=min_decay)
    step = ema(ft.train_step(problem.loss_fn, ft.optim.adamw(1e-2)))
    state = ftt.state_at(step, problem.params, t0, slots={"ema": lambda slot, t: slot._replace(count=torch.tensor(t))})
    ref = ft.tree.tree_map(lambda p: p.double(), problem.params)
    for k in range(t0 + 1, t0 + steps + 1):
        new, _ = step(state, shifted(problem.batch, k - t0))
        if k <= start_step:
            ref = ft.tree.tree_map(lambda p: p.double(), new.params)
        elif k % every == 0:
            d = _ramp(k, decay, start_step, power, inv_gamma, min_decay)
            ref = ft.tree.tree_map(lambda e, p: d * e + (1 - d) * p.double(), ref, new.params)
        else:
            ftt.assert_same_state(new.ema, state.ema, what=f"EMA must not change at update {k}")
        ftt.assert_same_state(ft.tree.tree_map(torch.Tensor.double, new.ema), ref, rtol=1e-6, atol=1e-6,
                              what=f"EMA at update {k}")
        state = new


@FAST
@given(problem=ftt.mlp_problems(), steps=st.integers(1, 12), lr=st.sampled_from([1e-2, 1e-1]))
def test_ema_warmup_with_power_one_is_the_running_mean(problem, steps, lr):
    """power = inv_gamma = 1 (every = 1, start_step = 0, decay 0.9999 not reached): d_k = k / (k + 1), whose
    products telescope: after k updates the EMA is the plain mean of the initial params and the k updated ones
    (crowsonkb's "simple average"). The mean is taken here over the params the step returned, in float64.
    rtol = atol = 1e-5: <= 12 fp32 lerps, each within an ulp, of O(1) values."""
    step = ft.ema(0.9999, start_step=0, power=1.0)(ft.train_step(problem.loss_fn, ft.optim.adamw(lr)))
    state = step.init(problem.params)
    seen = [ft.tree.tree_map(torch.Tensor.double, problem.params)]
    for k in range(1, steps + 1):
        state, _ = step(state, shifted(problem.batch, k))
        seen.append(ft.tree.tree_map(torch.Tensor.double, state.params))
    mean = ft.tree.tree_map(lambda *ps: sum(ps) / len(ps), *seen)
    ftt.assert_same_state(ft.tree.tree_map(torch.Tensor.double, state.ema), mean, rtol=1e-5, atol=1e-5,
                          what=f"EMA after {steps} updates vs the mean of {len(seen)} params")


@FAST
@given(problem=ftt.mlp_problems(), decay=st.floats(0.5, 0.999), every=st.integers(1, 3), start_step=st.integers(0, 3),
       power=st.floats(0.25, 2.0), steps=st.integers(1, 10), seed=st.integers(0, 2**31 - 1))
def test_ema_warmup_closed_form_for_constant_params(problem, decay, every, start_step, power, steps, seed):
    """lr = 0 keeps the params p constant; the EMA starts from e0 != p. With no copy (start_step = 0) the
    closed form is ema = P * e0 + (1 - P) * p with P the product of the ramp's d_k over the blends k =
    every, 2 every, ... <= steps; with copies (start_step > 0) the EMA is p from update 1 on, bitwise."""
    ema = ft.ema(decay, every=every, start_step=start_step, power=power)
    step = ema(ft.train_step(problem.loss_fn, ft.optim.sgd(0.0)))
    state = step.init(problem.params)
    gen = torch.Generator().manual_seed(seed)
    e0 = ft.tree.tree_map(lambda p: torch.randn(p.shape, generator=gen), problem.params)
    state = state.replace(slots={**state.slots, "ema": ft.EmaState(e0, state.slots["ema"].count)})
    state, _ = ftt.run_steps(step, state, problem.batch, steps)
    if start_step:
        ftt.assert_same_state(state.ema, problem.params, what="EMA after a copy of constant params")
        return
    prod = 1.0
    for k in range(every, steps + 1, every):
        prod *= _ramp(k, decay, 0, power, 1.0, 0.0)
    expected = ft.tree.tree_map(lambda e, p: prod * e.double() + (1 - prod) * p.double(), e0, problem.params)
    ftt.assert_same_state(ft.tree.tree_map(torch.Tensor.double, state.ema), expected, rtol=1e-5, atol=1e-6)


def test_ema_every_counts_applied_updates_not_calls():
    """A skipped (non-finite) update does not count: with every=2 the EMA blends on the 2nd and 4th *applied*
    update, so an inf batch at call 2 moves the blends to calls 3 and 5. The same holds traced (aot_eager)."""
    params, batches = fixed_problem()
    step = ft.skip_nonfinite()(ft.ema(0.5, every=2, warmup=False)(ft.train_step(ftt.mlp_loss, ft.optim.adamw(1e-2))))
    batch = lambda i: with_value(batches[i], float("inf")) if i == 1 else batches[i]  # noqa: E731
    for run in (step, ft.compile(step, backend="aot_eager")):
        state = step.init(params)
        changed = []
        for i in range(5):
            new, _ = run(state, batch(i))
            changed.append(not ft.tree.tree_equal(new.ema, state.ema))
            state = new
        assert changed == [False, False, True, False, True], changed
        assert int(state.slots["ema"].count) == 4


def test_ema_decay_at_and_the_trainer_default_is_the_package_ramp():
    """The trainer's default EMA is ema-pytorch's as denoising-diffusion-pytorch builds it: copies for 100 updates,
    then 1 - (1 + t)^(-2/3) capped at 0.995 (0.995 is reached at t = 2828)."""
    from functrain.trainer.build import config_ema

    e = config_ema(ft.TrainConfig())
    assert (e.decay, e.every, e.start_step, e.power, e.inv_gamma, e.min_decay) == (0.995, 10, 100, 2 / 3, 1.0, 0.0)
    assert e.decay_at(110) == pytest.approx(1 - 11 ** (-2 / 3), rel=1e-15)
    assert e.decay_at(100 + 2828) == 0.995 and e.decay_at(100 + 2827) < 0.995
    assert float(e.decay_at(torch.tensor(150))) == e.decay_at(150)
    plain = config_ema(ft.TrainConfig(ema_power=None, ema_update_after_step=0))
    assert (plain.power, plain.start_step, plain.decay_at(1)) == (None, 0, 0.995)


@pytest.mark.parametrize("make, value", [
    (lambda: ft.ema(1.5, warmup=False), "1.5"), (lambda: ft.ema(0.9, every=0, warmup=False), "0"),
    (lambda: ft.ema(0.9, start_step=-1, warmup=False), "-1"),
    (lambda: ft.ema(0.9, power=0.0), "power must be a number > 0"), (lambda: ft.ema(0.9, power=1, inv_gamma=-1),
                                                                       "inv_gamma must be a number > 0"),
    (lambda: ft.ema(0.9, power=1, min_decay=0.95), "min_decay must be a number in [0, decay=0.9]; got 0.95"),
    (lambda: ft.ema(0.9, inv_gamma=2.0, warmup=False), "with power=None they would be unused"),
])
def test_ema_invalid_arguments_raise_with_value(make, value):
    with pytest.raises(ValueError) as info:
        make()
    assert value in str(info.value)
