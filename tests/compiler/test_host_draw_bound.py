"""Issue 36 row 3: a step that flips 12 Python coins per call has 4,096 outcomes, each a capture of its own; before,
every call with a new outcome traced and compiled another graph, with no end (2.8-3.4 s and ~0.6 MiB a call under
inductor). Now the captures of one input signature's outcomes are bounded (``FUNCTRAIN_COMPILE_DRAW_CAPTURES``,
default 8, as Dynamo's recompile limit): past the bound one warning names it, and a call whose outcome has no
capture runs the eager step (the captured outcomes stay compiled); the results equal the eager step's."""
from __future__ import annotations

import random
import warnings

import pytest
import torch

import functrain as ft
from functrain import tree as T
from functrain.compiler.settings import DRAW_CAPTURES, BadSetting, WorkerSettings

COINS = 12


def _coins_loss(params, buffers, x):
    y = (params["w"] * x).sum()
    for k in range(COINS):
        if random.random() < 0.5:  # coin k
            y = y * (1.0 + 0.01 * (k + 1))
    return y


with open(__file__) as _f:
    _DRAW_LINE = next(i + 1 for i, line in enumerate(_f) if line.rstrip().endswith("# coin k"))


def _three_coins(params, buffers, x):
    y = (x @ params["w"]).square().mean()
    for k in range(3):
        if random.random() < 0.5:
            y = y * (1.0 + 0.1 * (k + 1))
    return y


def _step():
    return ft.train_step(_coins_loss, ft.optim.sgd(0.01))


def _batch(i):
    return torch.arange(3.0) + i


def _bound_warnings(caught):
    return [str(w.message) for w in caught if "FUNCTRAIN_COMPILE_DRAW_CAPTURES" in str(w.message)]


def test_twelve_coins_compile_at_most_the_bound_then_run_eagerly_with_one_warning():
    """The attacker's step, 14 calls from a plain compiled step (the default bound, 8): 8 graphs and no more,
    one warning naming the bound and the coin's line, every call equal to the eager step bitwise; a later call
    whose outcome was captured runs compiled, one whose outcome was not runs eagerly."""
    assert DRAW_CAPTURES == 8 and WorkerSettings().draw_captures == 8
    step = _step()
    cstep = ft.compile(step, backend="aot_eager")
    run = cstep.runner()
    a = b = step.init({"w": torch.ones(3)}, seed=0)
    inputs = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i in range(14):
            inputs.append(b)
            a, ma = step(a, _batch(i))
            b, mb = run(b, _batch(i))
            assert T.tree_equal(a.params, b.params) and torch.equal(ma["loss"], mb["loss"]), i
            assert cstep.compiles <= 8
    assert cstep.compiles == 8  # (14 calls of 12 coins: 14 outcomes, 8 of them captured)
    said = _bound_warnings(caught)
    assert len(said) == 1, said
    assert "FUNCTRAIN_COMPILE_DRAW_CAPTURES=8" in said[0] and f"{__file__}:{_DRAW_LINE} in _coins_loss" in said[0]
    assert "runs the eager step from now on" in said[0]
    assert run.progress.eager_calls == 6 and run.rates.calls["compiled"] == 8
    # the first call's outcome has its capture: compiled again, nothing new compiled, nothing said
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        again, _ = run(inputs[0], _batch(0))
        late, _ = run(inputs[-1], _batch(13))
    assert run.rates.calls["compiled"] == 9 and run.progress.eager_calls == 7 and cstep.compiles == 8
    assert not _bound_warnings(caught)
    assert T.tree_equal(again.params, step(inputs[0], _batch(0))[0].params)
    assert T.tree_equal(late.params, a.params)


def test_the_bound_is_a_setting(monkeypatch):
    """FUNCTRAIN_COMPILE_DRAW_CAPTURES=3: three graphs, then eager calls (equal to the eager step); a bad value
    is refused by ft.compile naming the variable, the value and what is allowed."""
    monkeypatch.setenv("FUNCTRAIN_COMPILE_DRAW_CAPTURES", "3")
    step = _step()
    cstep = ft.compile(step, backend="aot_eager")
    assert cstep.settings.draw_captures == 3
    a = b = step.init({"w": torch.ones(3)}, seed=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i in range(6):
            a, _ = step(a, _batch(i))
            b, _ = cstep(b, _batch(i))
            assert T.tree_equal(a.params, b.params), i
    assert cstep.compiles == 3
    said = _bound_warnings(caught)
    assert len(said) == 1 and "FUNCTRAIN_COMPILE_DRAW_CAPTURES=3" in said[0], said
    for bad in ("0", "4097", "two", "2.5", ""):
        monkeypatch.setenv("FUNCTRAIN_COMPILE_DRAW_CAPTURES", bad)
        with pytest.raises(BadSetting) as info:
            ft.compile(step, backend="aot_eager")
        assert str(info.value).startswith("FUNCTRAIN_COMPILE_DRAW_CAPTURES must be an integer from 1 to 4096")
        assert repr(bad) in str(info.value)
    assert WorkerSettings.from_env({"FUNCTRAIN_COMPILE_DRAW_CAPTURES": "4096"}).draw_captures == 4096


def test_under_inductor_the_bound_holds(monkeypatch):
    """The default backend (inductor, the C++ compile the bound saves), a bound of 1: one graph, then the calls
    with another outcome run eagerly; every call equals the eager step to inductor's rounding."""
    monkeypatch.setenv("FUNCTRAIN_COMPILE_DRAW_CAPTURES", "1")
    step = ft.train_step(_three_coins, ft.optim.sgd(0.1))
    cstep = ft.compile(step)
    run = cstep.runner()
    a = b = step.init({"w": torch.ones(4, 2)}, seed=5)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i in range(6):
            batch = torch.randn(8, 4, generator=torch.Generator().manual_seed(i))
            a, _ = step(a, batch)
            b, _ = run(b, batch)
            torch.testing.assert_close(b.params["w"], a.params["w"], rtol=1e-5, atol=1e-6)
    assert cstep.compiles == 1 and len(_bound_warnings(caught)) == 1
    assert run.progress.eager_calls >= 1 and run.rates.calls["compiled"] >= 1


def test_under_ft_run_the_bound_holds_and_the_run_equals_the_eager_steps():
    """ft.run's runner (donating, compiling in the background, the switch at step 2: each new outcome from there
    waits for its compile): 8 graphs, one warning, eager calls past the bound (they retire the donated input as
    the background component's eager calls do), and the final state equals the eager loop's, bitwise."""
    step = _step()
    cstep = ft.compile(step, backend="aot_eager", switch_at=2)
    run = cstep.runner(donate=True, background=True)
    start = step.init({"w": torch.ones(3)}, seed=2)
    eager = start
    for i in range(16):
        eager, _ = step(eager, _batch(i))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        state = ft.run(run, start, [_batch(i) for i in range(16)], num_steps=16, progress=False)
    assert cstep.compiles == 8
    assert len(_bound_warnings(caught)) == 1
    assert run.rates.calls["compiled"] == 8 and run.rates.calls["eager"] == 8  # (2 before the switch, 6 past)
    assert T.tree_equal(state.params, eager.params) and torch.equal(state.rng["key"], eager.rng["key"])


def _two_ranks_past_the_bound(seed):
    """Rank r: a data-parallel 3-coin step (8 outcomes) under a bound of 2, compiled in the background with the
    switch at step 2 (each new outcome from there waits for its compile, and the ranks agree on it), 12 steps on
    its own data beside the eager step."""
    import torch.distributed as dist

    step = ft.data_parallel()(ft.train_step(_three_coins, ft.optim.sgd(0.1)))
    cstep = ft.compile(step, backend="aot_eager", switch_at=2)
    runner = cstep.runner(background=True)
    state = eager = step.init({"w": torch.ones(4, 2)}, seed=seed)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i in range(12):
            batch = torch.randn(8, 4, generator=torch.Generator().manual_seed(100 * dist.get_rank() + i))
            state, _ = runner(state, batch)
            eager, _ = step(eager, batch)
    runner.close()
    return {"params": state.params["w"].tolist(), "eager": eager.params["w"].tolist(), "graphs": cstep.compiles,
            "calls": dict(runner.rates.calls), "said": len(_bound_warnings(caught)),
            "bound": cstep.settings.draw_captures}


def test_two_ranks_past_the_bound_run_the_same_calls_eagerly(monkeypatch):
    """2 gloo processes, FUNCTRAIN_COMPILE_DRAW_CAPTURES=2 (inherited): no hang; each rank compiled 2 graphs,
    warned once and made the same calls eagerly and compiled (the outcomes come from the replicated key); their
    params are the same and equal the eager data-parallel step's."""
    monkeypatch.setenv("FUNCTRAIN_COMPILE_DRAW_CAPTURES", "2")
    outs = ft.launch(_two_ranks_past_the_bound, nprocs=2, args=(4,), timeout=600)
    assert outs[0]["params"] == outs[1]["params"]
    assert outs[0]["calls"] == outs[1]["calls"], outs
    for out in outs:
        assert out["bound"] == 2 and out["graphs"] == 2 and out["said"] == 1, out
        assert out["calls"]["compiled"] > 0 and out["calls"]["eager"] > 2, out  # (2: before the switch)
        torch.testing.assert_close(torch.tensor(out["params"]), torch.tensor(out["eager"]), rtol=1e-6, atol=1e-7)
