"""A compiled step that branches on Python's random (denoising-diffusion-pytorch's self-conditioning coin,
``random() < 0.5`` through ``from random import random``): one capture per outcome, picked at each call from the
state's key; compiled == eager bitwise from the same state (a law), a resumed run is exact, ranks agree, and a
drawn number used as a number is refused at the trace by name."""
from __future__ import annotations

import random
import warnings
from random import random as bound_random  # bound at import, as p_losses binds it

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import functrain as ft
from functrain import tree as T
from functrain.core.rng import step_seed


def _coin_loss(params, buffers, x):
    """Two coins, each picking a branch; dropout draws from the state's torch generator too."""
    y = torch.nn.functional.dropout(x @ params["w"], 0.25)
    if bound_random() < 0.5:  # self-conditioning: a second pass, detached
        y = y + (x @ params["w"]).detach().tanh()
    scale = 2.0 if random.random() >= 0.7 else 1.0
    return (y.square().mean() * scale)


def _step():
    return ft.ema(0.9)(ft.train_step(_coin_loss, ft.optim.adamw(1e-2)))


def _batch(i):
    return torch.randn(8, 4, generator=torch.Generator().manual_seed(i))


@pytest.fixture(scope="module")
def compiled():
    """One compiled step for the module (aot_eager: eager kernels, so the law holds bitwise; inductor's fused
    arithmetic rounds differently and is checked within a tolerance below): its captures, one per outcome of the
    two coins, are compiled once and shared by the examples."""
    step = _step()
    return step, ft.compile(step, backend="aot_eager")


@settings(max_examples=12, deadline=None)
@given(seed=st.integers(0, 2**40), steps=st.integers(1, 6))
def test_compiled_equals_eager_bitwise_from_the_same_state(compiled, seed, steps):
    """The law: from the same state, the compiled step and the eager step give the same params, EMA, metrics and
    key, bitwise, every step (the coins come from the state's key in both)."""
    step, cstep = compiled
    a = b = step.init({"w": torch.randn(4, 3, generator=torch.Generator().manual_seed(seed % 97))}, seed=seed)
    for i in range(steps):
        a, ma = step(a, _batch(i))
        b, mb = cstep(b, _batch(i))
        assert T.tree_equal(a.params, b.params) and T.tree_equal(a.ema, b.ema), (seed, i)
        assert torch.equal(ma["loss"], mb["loss"]) and torch.equal(a.rng["key"], b.rng["key"])


def test_each_outcome_is_compiled_once_and_picked_by_the_key(compiled):
    """Over many keys both branches of each coin are taken, each outcome's graph compiled once: no recompile after
    the outcomes are known, and the coin a call takes is the one the eager step takes (the loss says)."""
    step, cstep = compiled
    state = step.init({"w": torch.ones(4, 3)}, seed=123)
    outcomes = set()
    for i in range(24):
        rng = random.Random(step_seed(*state.rng["key"].tolist()))  # the step's Python seed, on every rank
        outcomes.add((rng.random() < 0.5, rng.random() >= 0.7))
        state, _ = cstep(state, _batch(i))
    assert len(outcomes) == 4
    before = cstep.compiles
    assert before <= 4 + 1  # one graph per outcome (at most one more: a step-count signature change)
    for i in range(24, 40):
        state, _ = cstep(state, _batch(i))
    assert cstep.compiles == before


def test_a_resumed_run_is_exact(compiled):
    """Steps 4..8 from a checkpoint of step 4 (a copy of the state, a fresh compiled step) equal the same steps of
    the run that went on."""
    step, cstep = compiled
    state = step.init({"w": torch.ones(4, 3)}, seed=7)
    for i in range(4):
        state, _ = cstep(state, _batch(i))
    saved = T.tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, state)
    for i in range(4, 8):
        state, _ = cstep(state, _batch(i))
    resumed, fresh = saved, ft.compile(_step(), backend="aot_eager")
    for i in range(4, 8):
        resumed, _ = fresh(resumed, _batch(i))
    assert T.tree_equal(state.params, resumed.params) and T.tree_equal(state.ema, resumed.ema)


def test_the_caller_s_python_generator_is_untouched(compiled):
    step, cstep = compiled
    random.seed(99)
    before = random.getstate()
    state = step.init({"w": torch.ones(4, 3)}, seed=1)
    for i in range(3):
        state, _ = cstep(state, _batch(i))
    assert random.getstate() == before


@pytest.mark.parametrize("use,named", [
    (lambda p, x: (x @ p["w"]).sum() * bound_random(), "__rmul__"),       # a tensor times the number
    (lambda p, x: (x @ p["w"]).sum() * torch.tensor(bound_random()), "passed to tensor"),  # a torch op given it
    (lambda p, x: (x @ p["w"]).sum() * (bound_random() + 1.0), "__add__"),  # arithmetic on it
    (lambda p, x: (x @ p["w"]).sum() * float(bound_random()), "__float__"),
])
def test_a_drawn_number_used_as_a_number_is_refused_by_name(use, named):
    """Only comparisons compile; any other use would freeze the number into the graph: HostRandomError at the trace,
    naming the draw's line and the use, and nothing compiled."""
    step = ft.train_step(lambda p, b, x: use(p, x), ft.optim.sgd(0.1))
    cstep = ft.compile(step, backend="aot_eager")
    state = step.init({"w": torch.ones(4, 3)}, seed=0)
    with pytest.raises(ft.HostRandomError) as info:
        cstep(state, _batch(0))
    message = str(info.value)
    assert message.startswith("ft.compile: the number drawn by random.random() at ") and __file__ in message
    assert "was used as a number (" in message and named in message, message
    assert cstep.compiles == 0


def test_the_trainer_trains_self_conditioning_compiled_and_equal_to_eager(tmp_path):
    """ft.Trainer with compile on (background, the switch fixed at step 2 so that the compiled code runs from there):
    no failed compile, no warning; the compiled steps ran; the params equal the eager Trainer's, bitwise."""
    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(4, 1)

        def forward(self, x, y):
            out = self.fc(x)
            if bound_random() < 0.5:
                out = out + self.fc(x).detach()
            return torch.nn.functional.mse_loss(out, y)

    x = torch.randn(64, 4, generator=torch.Generator().manual_seed(0))
    data = torch.utils.data.TensorDataset(x, x[:, :1] * 0.5)
    trainers = {}
    for compile in (True, False):
        torch.manual_seed(0)
        config = ft.TrainConfig(train_batch_size=8, train_num_steps=10, save_and_sample_every=10, log_every=5,
                                compile=compile, compile_switch_at=2 if compile else None,
                                results_folder=str(tmp_path / str(compile)), trackers=("jsonl",), seed=3)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer = ft.Trainer(Model(), data, config)
            trainer.train()
        trainers[compile] = trainer
        assert not [w for w in caught if "compile failed" in str(w.message)], [str(w.message) for w in caught]
    progress = trainers[True].run_step.progress
    assert progress.phase == "compiled" and progress.reason is None, progress
    assert trainers[True].run_step.rates.calls["compiled"] >= 7
    assert T.tree_equal(trainers[True].state.params, trainers[False].state.params)


def _two_ranks(seed):
    """Rank r: the data-parallel coin step, compiled in the background with the switch at step 3 (the ranks agree
    there, and again on every new outcome's compile: a call whose capture one rank had and the other not would hang
    in that agreement), 10 steps on its own data, and the eager step alongside."""
    import torch.distributed as dist

    step = ft.data_parallel()(_step())
    runner = ft.compile(step, backend="aot_eager", switch_at=3).runner(background=True)
    state = eager = step.init({"w": torch.ones(4, 3)}, seed=seed)
    for i in range(10):
        batch = _batch(100 * dist.get_rank() + i)
        state, _ = runner(state, batch)
        eager, _ = step(eager, batch)
    runner.close()
    return {"params": state.params["w"].tolist(), "eager": eager.params["w"].tolist(),
            "compiled_calls": runner.rates.calls["compiled"], "phase": runner.progress.phase,
            "reason": runner.progress.reason}


def test_two_ranks_take_the_same_branch_and_switch_together():
    """2 gloo processes: no hang, both run compiled calls, their params are the same (replicated) and equal the eager
    data-parallel step's (Python's coin is drawn alike on every rank from the replicated key)."""
    outs = ft.launch(_two_ranks, nprocs=2, args=(5,), timeout=600)
    assert outs[0]["params"] == outs[1]["params"]
    for out in outs:
        assert out["compiled_calls"] > 0 and out["phase"] != "failed", out
        torch.testing.assert_close(torch.tensor(out["params"]), torch.tensor(out["eager"]), rtol=1e-6, atol=1e-7)
