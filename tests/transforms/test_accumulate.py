"""accumulate(n): the big batch, item-count normalisation, streaming (issue 3 laws, hypothesis)."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import functrain as ft
import functrain.testing as ftt
from conftest import FAST, OPTIMIZERS, fixed_problem, optimizers, shifted, train_state_parts, with_value


# -- accumulate(n) == the big batch ----------------------------------------------------------
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


# -- aux["num_items"]: accumulate(n) == the big batch's token mean ---------------------------
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


# -- streaming accumulation ------------------------------------------------------------------
@FAST
@given(problem=ftt.mlp_problems(n=st.integers(2, 4)), opt=optimizers, windows=st.integers(1, 2))
def test_streaming_equals_accumulate_and_big_batch(problem, opt, windows):
    n = problem.n
    base = ft.ema(0.8, warmup=False)(ft.train_step(problem.loss_fn, OPTIMIZERS[opt]()))
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
        return ft.ema(0.9, warmup=False)(ft.accumulate(n, streaming=streaming)(mp(ft.train_step(problem.loss_fn, ft.optim.adamw(1e-2)))))

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


# -- bad input --------------------------------------------------------------------------------
def test_accumulate_indivisible_batch_names_leaf_and_n():
    params, batches = fixed_problem()
    step = ft.accumulate(3)(ft.train_step(ftt.mlp_loss, ft.optim.sgd(0.1)))
    x, y = batches[0]
    with pytest.raises(ValueError, match=r"accumulate\(3\).*'x'.*8.*divisible by 3"):
        step(step.init(params), {"x": x, "y": y})


@pytest.mark.parametrize("make, value", [(lambda: ft.accumulate(0), "0"), (lambda: ft.accumulate(2.5), "2.5")])
def test_accumulate_invalid_arguments_raise_with_value(make, value):
    with pytest.raises(ValueError) as info:
        make()
    assert value in str(info.value)
