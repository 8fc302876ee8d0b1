"""Step.check_state: a state that does not match the step is refused before anything runs, naming the difference.

Each case is given to the eager step, to a compiled step (which must refuse it
before tracing: no graph is built), and to ``step.check_state`` itself.
"""
from __future__ import annotations

import pytest
import torch

import functrain as ft
from functrain.core.validate import BadValue


def loss_fn(params, buffers, x):
    return (params["w"] * x).sum()


def build(*transforms, optimizer=None):
    step = ft.train_step(loss_fn, optimizer or ft.optim.sgd(0.1))
    for t in transforms:
        step = t(step)
    return step


PARAMS = {"w": torch.ones(3)}
X = torch.ones(3)


def state_of(*transforms, optimizer=None):
    return build(*transforms, optimizer=optimizer).init(PARAMS)


CASES = {
    # name: (step transforms, the state given, the message it must raise)
    "extra slot": (lambda: build(), lambda: state_of(ft.ema(0.9, warmup=False)),
                   r"state.slots has 'ema' but this step has no 'ema' transform; expected slots \[\]"),
    "missing slot": (lambda: build(ft.mixed_precision("fp16")), lambda: state_of(),
                     r"state.slots lacks 'mixed_precision': this step's mixed_precision.* keeps LossScaleState"),
    "slot of a stateless transform": (
        lambda: build(ft.mixed_precision("bf16")), lambda: state_of(ft.mixed_precision("fp16")),
        r"state.slots has 'mixed_precision' but this step's mixed_precision.*bfloat16.* keeps no state"),
    "differently typed slot": (
        lambda: build(ft.ema(0.9, warmup=False)),
        lambda: (lambda s: s.replace(slots={"ema": {"params": s.slots["ema"].params}}))(state_of(ft.ema(0.9, warmup=False))),
        r"state.slots\['ema'\] is dict but this step's ema\(0.9.* keeps EmaState"),
    "float step": (lambda: build(), lambda: state_of().replace(step=torch.zeros(())),
                   r"state.step must be an int64 scalar tensor .*got a torch.float32 tensor of shape \(\)"),
    "step as a Python int": (lambda: build(), lambda: state_of().replace(step=3),
                             r"state.step must be an int64 scalar tensor .*got int"),
    "other optimizer": (lambda: build(optimizer=ft.optim.adamw(1e-3)), lambda: state_of(),
                        r"state.opt_state is SGDState but this step's optimizer keeps AdamState"),
    "slots not a dict": (lambda: build(), lambda: state_of().replace(slots=None),
                         r"state.slots must be a dict .*got NoneType"),
    "bad rng": (lambda: build(), lambda: state_of().replace(rng={"key": torch.zeros(3, dtype=torch.int64)}),
                r"state.rng must be None or \{'key': int64 CPU tensor \[seed, counter\]\}"),
    "float rng key": (lambda: build(), lambda: state_of().replace(rng={"key": torch.zeros(2)}),
                      r"state.rng must be None or"),
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("how", ["check_state", "eager", "compiled"])
def test_mismatched_state_is_named(case, how):
    make_step, make_state, message = CASES[case]
    step, state = make_step(), make_state()
    with pytest.raises(BadValue, match=message) as info:
        if how == "check_state":
            step.check_state(state)
        elif how == "eager":
            step(state, X)
        else:
            compiled = ft.compile(step, backend="eager")
            try:
                compiled(state, X)
            finally:
                assert compiled.compiles == 0, "the state was traced before it was checked"
    assert isinstance(info.value, TypeError) and isinstance(info.value, ValueError)
    assert "the state does not match this step" in str(info.value)


def test_every_difference_is_named_at_once():
    step = build(ft.mixed_precision("fp16"), optimizer=ft.optim.adamw(1e-3))
    with pytest.raises(BadValue) as info:
        step(state_of(ft.ema(0.9, warmup=False)).replace(step=torch.zeros(())), X)
    text = str(info.value)
    for part in ("state.step must be", "state.opt_state is SGDState", "has 'ema'", "lacks 'mixed_precision'"):
        assert part in text, part


def test_matching_states_are_accepted():
    """States made by the step, returned by it, from another step object with the same transforms, with and
    without a seed, and loaded from a checkpoint, all run."""
    step = build(ft.ema(0.9, warmup=False), ft.mixed_precision("fp16"), ft.accumulate(2, streaming=True), ft.skip_nonfinite())
    twin = build(ft.ema(0.9, warmup=False), ft.mixed_precision("fp16"), ft.accumulate(2, streaming=True), ft.skip_nonfinite())
    for state in (step.init(PARAMS), step.init(PARAMS, seed=None), step(step.init(PARAMS), X)[0]):
        step.check_state(state)
        twin.check_state(state)  # twin never ran init: its expectations come from meta tensors
        twin(state, X)
    assert twin._expected.unknown == frozenset()


def test_slot_of_an_init_that_needs_values_is_still_checked():
    class ValueInit(ft.Transform):  # reads a value in init: cannot run on meta tensors
        name = "value_init"

        def init(self, params, buffers):
            return {"first": torch.tensor(float(params["w"][0]))}

    state = build(ValueInit()).init(PARAMS)
    fresh = build(ValueInit())  # has not seen init: falls back to the real tensors, once
    fresh.check_state(state)
    with pytest.raises(BadValue, match="lacks 'value_init'"):
        build(ValueInit()).check_state(state_of())


def test_donated_and_foreign_states_keep_their_errors():
    step = build()
    with pytest.raises(TypeError, match="TrainState"):
        step.check_state({"params": {}})
    state = step.init({"w": torch.ones(3)})
    for leaf in ft.tree.tree_leaves(state):
        leaf.set_()  # what donation does to the old state
    with pytest.raises(RuntimeError, match="donated"):
        step(state, X)
