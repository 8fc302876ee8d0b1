"""Every subset of the built-in transforms compiles to one graph that equals the eager step, with no recompiles."""
from __future__ import annotations

import itertools

import pytest

import functrain as ft
import functrain.testing as ftt
from conftest import EPS, ScaleGrads, fixed_problem, update_of, with_value


BUILTINS = {"accumulate": lambda: ft.accumulate(2), "bf16": lambda: ft.mixed_precision("bf16"),
            "clip": lambda: ft.clip(0.5), "ema": lambda: ft.ema(0.9, every=2, warmup=False)}


SUBSETS = [c for r in range(5) for c in itertools.combinations(BUILTINS, r)]


EXTRA = {
    "streaming+clip+ema": [lambda: ft.accumulate(2, streaming=True), BUILTINS["clip"], BUILTINS["ema"]],
    "streaming+fp16+ema": [lambda: ft.accumulate(2, streaming=True), lambda: ft.mixed_precision(
        "fp16", init_scale=2.0**8, growth_interval=3), BUILTINS["ema"]],
    "all-four-fp16": [BUILTINS["accumulate"], lambda: ft.mixed_precision("fp16", init_scale=2.0**8, growth_interval=3),
                      BUILTINS["clip"], BUILTINS["ema"]],
    "skip_nonfinite+accumulate+bf16+ema": [ft.skip_nonfinite, BUILTINS["accumulate"], BUILTINS["bf16"], BUILTINS["ema"]],
    "clip+clip_value+scale_grads": [BUILTINS["clip"], lambda: ft.clip_value(0.05), lambda: ScaleGrads(0.5)],
    # the warm-up's decay is a tensor of the traced count (no host read), eager's a Python float
    "ema_warmup": [lambda: ft.ema(0.95, every=2, start_step=3, power=2 / 3, inv_gamma=2.0)],
    "skip_nonfinite+bf16+ema_warmup": [ft.skip_nonfinite, BUILTINS["bf16"],
                                       lambda: ft.ema(0.95, every=1, start_step=2, power=1.0, min_decay=0.1)],
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
