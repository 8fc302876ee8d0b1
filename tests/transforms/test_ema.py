"""ema(decay, every, start_step): the hand-computed average and the closed form for constant params."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import functrain as ft
import functrain.testing as ftt
from conftest import FAST, shifted


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


@pytest.mark.parametrize("make, value", [
    (lambda: ft.ema(1.5), "1.5"), (lambda: ft.ema(0.9, every=0), "0"), (lambda: ft.ema(0.9, start_step=-1), "-1"),
])
def test_ema_invalid_arguments_raise_with_value(make, value):
    with pytest.raises(ValueError) as info:
        make()
    assert value in str(info.value)
