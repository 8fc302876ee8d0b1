"""ft.fit_batch: the largest micro-batch whose ft.memory estimate fits a budget, and the first step that halves it
on an out-of-memory error (injected here: the CPU has no such error by itself)."""
import pytest
import torch

import functrain as ft

GLOBAL = 32


def _loss(p, b, batch):
    x, y = batch
    return ((torch.relu(x @ p["w1"]) @ p["w2"]).squeeze(-1) - y).square().mean()


def _setup():
    g = torch.Generator().manual_seed(0)
    params = {"w1": torch.randn(8, 1024, generator=g) * 0.1, "w2": torch.randn(1024, 1, generator=g) * 0.1}
    step = ft.train_step(_loss, ft.optim.adamw(1e-2))
    batch = (torch.randn(GLOBAL, 8, generator=g), torch.randn(GLOBAL, generator=g))
    return step, step.init(params), batch


def _estimate(step, state, batch, micro):
    n = GLOBAL // micro
    return ft.memory(ft.accumulate(n)(step) if n > 1 else step, state, batch, donate=True).total


def test_the_chosen_micro_batch_is_the_largest_whose_estimate_fits():
    step, state, batch = _setup()
    sizes = [32, 16, 8, 4, 2, 1]
    totals = {m: _estimate(step, state, batch, m) for m in sizes}
    # budgets the whole batch does not fit but smaller cuts do (the activations dominate this model)
    for budget in (min(totals.values()), (totals[32] + totals[16]) // 2):
        assert totals[32] > budget
        fit = ft.fit_batch(step, state, batch, budget=budget)
        assert totals[fit.micro] <= budget and fit.estimate.total == totals[fit.micro]
        assert all(totals[m] > budget for m in sizes if m > fit.micro)  # every larger cut is over the budget
    assert fit.micro == 16 and ft.fit_batch(step, state, batch, budget=min(totals.values())).micro < 16
    assert fit.accumulate == GLOBAL // fit.micro and fit.global_batch == GLOBAL and fit.budget == budget
    assert [t.name for t in fit.step.transforms] == ["accumulate"] and fit.step.micro_batches == fit.accumulate
    # the accumulate law: the cut does not change the update
    whole, _ = step(state, batch)
    cut, _ = fit.step(state, batch)
    torch.testing.assert_close(cut.params, whole.params)

    assert ft.fit_batch(step, state, batch, budget=totals[32]).micro == 32  # the whole batch fits its own total
    with pytest.raises(ValueError, match=r"even micro-batches of 1 rows \(accumulate\(32\) of the global batch 32\) "
                                         r"need about \d+ bytes, over the budget of 1000"):
        ft.fit_batch(step, state, batch, budget=1000)


def test_fit_batch_refuses_bad_input():
    step, state, batch = _setup()
    with pytest.raises(ValueError, match="already has ft.accumulate"):
        ft.fit_batch(ft.accumulate(2)(step), state, batch, budget=10**9)
    with pytest.raises(ValueError, match=r"one leading dimension \(the global batch\); got \[3, 32\]"):
        ft.fit_batch(step, state, (batch[0], batch[1][:3]), budget=10**9)
    with pytest.raises(ValueError, match="min_micro=64 is larger than the global batch 32"):
        ft.fit_batch(step, state, batch, budget=10**9, min_micro=64)
    with pytest.raises(ValueError, match="must be an int >= 1; got 0"):
        ft.fit_batch(step, state, batch, budget=0)
    with pytest.raises(TypeError, match="pass prepare=ft.compile"):
        ft.fit_batch(ft.compile(step, background=False), state, batch)


class _OOMAbove:
    """A step that fails as CUDA's allocator would for micro-batches larger than ``limit`` rows."""

    def __init__(self, step, limit, calls):
        self.step, self.limit, self.calls = step, limit, calls

    def __call__(self, state, batch):
        micro = batch[0].shape[0] // self.step.micro_batches
        self.calls.append(micro)
        if micro > self.limit:
            raise torch.OutOfMemoryError(f"CUDA out of memory (injected: {micro} rows)")
        return self.step(state, batch)


def test_an_out_of_memory_first_step_halves_until_it_fits_and_equals_that_cut_from_the_start():
    step, state, batch = _setup()
    before = {k: v.clone() for k, v in state.params.items()}
    calls = []
    fit = ft.fit_batch(step, state, batch, budget=10**12, prepare=lambda s: _OOMAbove(s, 3, calls))
    assert fit.micro == GLOBAL
    new_state, metrics, final = fit.first_step(state, batch)
    assert calls == [32, 16, 8, 4, 2]  # halved until it fit
    assert (final.micro, final.accumulate, final.estimate) == (2, 16, None)
    assert all(torch.equal(state.params[k], before[k]) for k in before)  # the state the retries started from
    expected, expected_metrics = ft.accumulate(16)(step)(state, batch)  # micro-batch 2 from the start
    assert all(torch.equal(new_state.params[k], expected.params[k]) for k in before)  # bitwise
    assert torch.equal(metrics["loss"], expected_metrics["loss"])
    # training goes on with the cut that worked
    again, _ = final.step.step(new_state, batch)
    assert torch.isfinite(again.params["w1"]).all()


def test_an_out_of_memory_error_at_the_smallest_micro_batch_is_raised_with_the_cuts_tried():
    step, state, batch = _setup()
    calls = []
    fit = ft.fit_batch(step, state, batch, budget=10**12, prepare=lambda s: _OOMAbove(s, 0, calls))
    tried = r"micro-batches tried: \[32, 16, 8, 4, 2, 1\]"
    with pytest.raises(torch.OutOfMemoryError,
                       match=r"even with micro-batches of 1 rows \(global batch 32, accumulate\(32\); " + tried) as e:
        fit.first_step(state, batch)
    assert "injected: 1 rows" in str(e.value.__cause__)
    calls.clear()
    fit = ft.fit_batch(step, state, batch, budget=10**12, min_micro=4, prepare=lambda s: _OOMAbove(s, 2, calls))
    with pytest.raises(torch.OutOfMemoryError, match=r"micro-batches tried: \[32, 16, 8, 4\], smallest allowed 4"):
        fit.first_step(state, batch)


def test_first_step_refuses_a_step_that_donates_its_input():
    step, state, batch = _setup()
    fit = ft.fit_batch(step, state, batch, budget=10**12, prepare=lambda s: ft.compile(s, donate=True,
                                                                                        background=False))
    with pytest.raises(ValueError, match=r"donates its input state .* prepare it with ft.compile\(step\)"):
        fit.first_step(state, batch)
