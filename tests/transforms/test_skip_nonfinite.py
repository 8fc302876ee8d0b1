"""skip_nonfinite: equals the plain step on the finite batches only, reports and counts each skip."""
from __future__ import annotations

import torch
from hypothesis import given
from hypothesis import strategies as st

import functrain as ft
import functrain.testing as ftt
from conftest import FAST, OPTIMIZERS, optimizers, shifted, train_state_parts, with_value


@FAST
@given(problem=ftt.mlp_problems(), opt=optimizers, bad=st.lists(st.booleans(), min_size=1, max_size=6),
       value=st.sampled_from([float("inf"), float("-inf"), float("nan")]), precision=st.sampled_from(["no", "bf16"]))
def test_skip_nonfinite_skips_and_counts(problem, opt, bad, value, precision):
    """skip_nonfinite equals the plain step run on the finite batches only (bitwise), reports
    each skip and counts them."""
    base = ft.ema(0.9, warmup=False)(ft.mixed_precision(precision)(ft.train_step(problem.loss_fn, OPTIMIZERS[opt]())))
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
