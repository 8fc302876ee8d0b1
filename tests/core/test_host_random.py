"""Python's random and numpy's global generator: owned by the state eagerly, refused while a step is captured.

Eagerly, ``with_rng`` seeds both from the state's key and restores the caller's: the same state gives the same
result, the caller's own draws are untouched. Compiled, a draw while the step is traced would be frozen into the
graph, so the capture raises ``HostRandomError`` naming the call and its caller (also ``from random import
random``, bound at import as denoising-diffusion-pytorch does); torch's own random ops are not refused.
"""
from __future__ import annotations

import random
import sys
from random import random as bound_random  # bound at import: what denoising-diffusion-pytorch's p_losses calls

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import functrain as ft
from conftest import FAST
from functrain.core.rng import HostRandomError, host_random_refused, with_rng


def _coin_loss(draw):
    """A loss whose value depends on a host draw (as p_losses' self-conditioning coin does)."""
    def loss_fn(params, buffers, x):
        scale = 2.0 if draw() < 0.5 else 1.0  # a Python branch on a host number: eagerly fine
        return (params["w"] * x).sum() * scale + draw() * (params["w"] ** 2).sum()
    return loss_fn


DRAWS = {"random.random": lambda: random.random(), "bound random()": lambda: bound_random(),
         "random.randint": lambda: random.randint(0, 9) / 10, "numpy.random.rand": lambda: float(np.random.rand()),
         "numpy.random.normal": lambda: float(np.random.normal())}


@FAST
@given(name=st.sampled_from(sorted(DRAWS)), seed=st.integers(0, 2**40), steps=st.integers(1, 4))
def test_eager_steps_draw_host_randomness_from_the_state(name, seed, steps):
    """Run twice from the same state: the same params and losses, bitwise; the caller's Python and numpy generators
    are where they were (a draw after the steps equals a draw from a saved copy); another seed differs."""
    step = ft.train_step(_coin_loss(DRAWS[name]), ft.optim.sgd(0.1))
    random.seed(123)
    np.random.seed(456)
    py_before, np_before = random.getstate(), np.random.get_state()
    runs = []
    for _ in range(2):
        state = step.init({"w": torch.ones(3)}, seed=seed)
        losses = []
        for _ in range(steps):
            state, m = step(state, torch.arange(3.0))
            losses.append(float(m["loss"]))
        runs.append((state.params["w"].clone(), losses))
        assert random.getstate() == py_before, "the caller's Python random was not restored"
        after = np.random.get_state()
        assert np.array_equal(after[1], np_before[1]) and after[2] == np_before[2], "numpy's state not restored"
    assert torch.equal(runs[0][0], runs[1][0]) and runs[0][1] == runs[1][1]
    others = set()
    for s in range(seed + 1, seed + 9):  # 8 other streams: a fair coin and a uniform draw differ in some
        state, m = step(step.init({"w": torch.ones(3)}, seed=s), torch.arange(3.0))
        others.add(float(m["loss"]))
    assert others - {runs[0][1][0]}, "the host draws do not depend on the state's key"


def test_python_draws_are_the_same_on_every_rank_numpy_draws_differ_by_rank():
    """Python's random is seeded from the step seed alone, on every rank: a branch on a draw (self-conditioning's coin)
    takes the same path on every rank, so compiled ranks run the same capture (functrain.compiler.host_draws).
    numpy's functions draw per rank (step seed + the rank offset), as torch's generator does."""
    state = None
    losses = {}
    for name in ("random.random", "numpy.random.rand"):
        step = ft.train_step(_coin_loss(DRAWS[name]), ft.optim.sgd(0.1))
        state = step.init({"w": torch.ones(3)}, seed=0)
        losses[name] = {r: float(with_rng(step.apply, state, torch.arange(3.0), r)[1]["loss"]) for r in range(4)}
        assert float(with_rng(step.apply, state, torch.arange(3.0), 2)[1]["loss"]) == losses[name][2]
    assert len(set(losses["random.random"].values())) == 1, losses
    assert len(set(losses["numpy.random.rand"].values())) > 1, losses
    # numpy's functions point at the step's generator only during the step
    assert np.random.rand.__self__ is np.random.mtrand._rand and np.random.normal.__self__ is np.random.mtrand._rand


@pytest.mark.parametrize("name,call", [("random.random", "random.random()"), ("bound random()", "random.random()"),
                                       ("random.randint", "random.randint()"),
                                       ("numpy.random.rand", "numpy.random.rand()"),
                                       ("numpy.random.normal", "numpy.random.normal()")])
def test_a_host_draw_while_capturing_is_refused_naming_the_call(name, call):
    """ft.compile (the default make_fx capture) raises HostRandomError naming the call, this file's line in the
    loss and the way out, instead of compiling a graph with the coin frozen; the generators are as before."""
    step = ft.train_step(_coin_loss(DRAWS[name]), ft.optim.sgd(0.1))
    state = step.init({"w": torch.ones(3)}, seed=0)
    cstep = ft.compile(step, backend="aot_eager")
    random.seed(7)
    np.random.seed(8)
    py_before, np_before = random.getstate(), np.random.get_state()
    with pytest.raises(HostRandomError) as info:
        cstep(state, torch.arange(3.0))
    message = str(info.value)
    if name in ("random.random", "bound random()"):  # recorded (host_draws), and refused where used as a number
        assert message.startswith("ft.compile: the number drawn by random.random() at "), message
        assert "was used as a number (__mul__)" in message, message  # draw() * tensor, in _coin_loss
    else:
        assert message.startswith(f"ft.compile: the step called {call} (")
    assert f"{__file__}:" in message and "in <lambda>" in message, message  # DRAWS' lambda, its caller
    assert "torch.rand((), device=x.device) < 0.5" in message and "compile=False" in message
    assert random.getstate() == py_before and np.array_equal(np.random.get_state()[1], np_before[1])
    assert cstep.compiles == 0  # nothing was compiled
    # the Dynamo path does not freeze either: under fullgraph=True torch.compile refuses the call (a graph
    # break, or for random.randint an internal Dynamo error on torch 2.13); fullgraph=False draws per call
    with pytest.raises((ft.GraphBreakError, torch._dynamo.exc.TorchDynamoException)):
        ft.compile(step, backend="eager", capture="dynamo")(state, torch.arange(3.0))


def test_torch_randomness_compiles_and_is_not_refused():
    """A coin drawn with torch ops (the recipe in the error) compiles to one graph, equals the eager step, and
    advances with the state's key."""
    def loss_fn(params, buffers, x):
        coin = torch.rand((), device=x.device) < 0.5
        return torch.where(coin, 2.0, 1.0) * (params["w"] * x).sum()

    step = ft.train_step(loss_fn, ft.optim.sgd(0.1))
    state = step.init({"w": torch.ones(3)}, seed=0)
    cstep = ft.compile(step, backend="aot_eager")
    a, b = state, state
    for _ in range(6):
        a, ma = cstep(a, torch.arange(3.0))
        b, mb = step(b, torch.arange(3.0))
        assert torch.equal(ma["loss"], mb["loss"])
    assert cstep.compiles == 1 and torch.equal(a.params["w"], b.params["w"])


def test_with_a_profiler_active_a_changed_generator_is_still_refused():
    """Another profile function (cProfile, a debugger) keeps its place; the refusal then rests on the generators'
    states, without the call's name."""
    seen = []

    def other(frame, event, arg):
        seen.append(event)

    previous = sys.getprofile()
    sys.setprofile(other)
    try:
        with pytest.raises(HostRandomError, match=r"Python.s random generator changed \(a profiler is active, so the call is not known\)"):
            with host_random_refused("test"):
                random.random()
        assert sys.getprofile() is other
        with host_random_refused("test"):  # nothing drawn: nothing refused
            torch.rand(2)
    finally:
        sys.setprofile(previous)
    assert seen


def test_a_capture_runs_without_the_profile_hook_and_traces_again_only_to_name_a_draw():
    """The hook that names a draw doubles a trace's time, so ft.compile traces without it; only a step that drew
    from Python's random is traced a second time, with the hook, for the name (the test above checks the name)."""
    profiles = []

    def clean_loss(params, buffers, x):
        profiles.append(sys.getprofile())
        return (params["w"] * x).sum()

    step = ft.train_step(clean_loss, ft.optim.sgd(0.1))
    ft.compile(step, backend="aot_eager")(step.init({"w": torch.ones(3)}), torch.arange(3.0))
    assert profiles == [None], profiles  # one trace, no hook

    profiles.clear()

    def drawing_loss(params, buffers, x):
        profiles.append(sys.getprofile())
        return (params["w"] * x).sum() * random.randint(1, 2)  # (a draw the trace cannot record: host_draws)

    step = ft.train_step(drawing_loss, ft.optim.sgd(0.1))
    with pytest.raises(HostRandomError, match=r"the step called random.randint\(\) .* in drawing_loss"):
        ft.compile(step, backend="aot_eager")(step.init({"w": torch.ones(3)}), torch.arange(3.0))
    assert len(profiles) == 2 and profiles[0] is None and profiles[1] is not None, profiles
    assert sys.getprofile() is None
    # unwatched, the refusal rests on the state, and says the call is not known
    with pytest.raises(HostRandomError, match=r"changed \(calls were not watched, so the call") as info:
        with host_random_refused("test", name_calls=False):
            bound_random()
    assert info.value.unnamed


def test_a_numpy_function_bound_before_is_refused_by_the_state_change():
    from numpy.random import rand as bound_rand

    with pytest.raises(HostRandomError, match=r"numpy's global generator changed \(a numpy.random function bound"):
        with host_random_refused("test"):
            bound_rand()
    assert np.random.rand is not None and getattr(np.random.rand, "__self__", None) is np.random.mtrand._rand


def test_reading_or_setting_a_generators_state_is_not_a_draw():
    with host_random_refused("test"):
        random.getstate()
        np.random.get_state()
    assert sys.getprofile() is None


def test_an_error_inside_the_block_passes_through():
    with pytest.raises(KeyError, match="mine"):
        with host_random_refused("test"):
            random.random()
            raise KeyError("mine")
    assert sys.getprofile() is None


def test_a_user_error_under_compile_names_the_capture_not_dynamo():
    """The note on a user error inside a compiled step names the tracer that failed (the default capture is
    make_fx, not Dynamo) and the error's real class; no torch._dynamo.exc.AttributeError, which does not exist."""
    def loss_fn(params, buffers, x):
        return x.no_such_attribute

    step = ft.train_step(loss_fn, ft.optim.sgd(0.1))
    with pytest.raises(AttributeError) as info:
        ft.compile(step, backend="aot_eager")(step.init({"w": torch.ones(3)}), torch.ones(3))
    notes = " ".join(getattr(info.value, "__notes__", []))
    assert "make_fx trace of it failed with AttributeError" in notes, notes
    assert "torch._dynamo.exc.AttributeError" not in notes
