"""ft.compile's fast path (functrain/compiler/capture.py): one capture, a direct call on flat leaves.

The guard (structure / shape / stride / dtype / device / baked values -> a counted
recompile or a clear error, never a wrong result), donation (explicit and ft.run's
owned donation), the RNG skip (no generator work when the graph draws nothing,
exact RNG when it does), and laws on the new path. Most tests use backend="aot_eager"
(seconds); one uses inductor.
"""
import pytest
import torch
from hypothesis import given, settings, strategies as st

from conftest import donating_loop

import functrain as ft
from functrain import tree as T
from functrain.compiler.capture import draws_random


def problem(dropout=0.0, d=8, seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(d, 16), torch.nn.ReLU(), torch.nn.Dropout(dropout),
                                torch.nn.Linear(16, 1))
    apply_fn, params, buffers = ft.functionalize(model)

    def loss_fn(params, buffers, batch):
        x, y = batch
        return torch.nn.functional.mse_loss(apply_fn(params, buffers, x), y)

    step = ft.train_step(loss_fn, ft.optim.adamw(1e-2))
    g = torch.Generator().manual_seed(seed + 1)
    batches = [(torch.randn(12, d, generator=g), torch.randn(12, 1, generator=g)) for _ in range(6)]
    return step, params, buffers, batches


def fresh(params):
    return {k: v.clone() for k, v in params.items()}


@pytest.fixture(scope="module")
def mlp():
    step, params, buffers, batches = problem()
    cstep = ft.compile(step, backend="aot_eager")
    state = step.init(fresh(params), buffers)
    cstep(state, batches[0])
    return step, cstep, params, buffers, batches


def test_the_fast_path_is_taken(mlp):
    _, cstep, *_ = mlp
    assert isinstance(cstep._own, ft.compiler.Runner) and cstep._own.last is not None
    assert isinstance(ft.compile(mlp[0], backend="aot_eager", capture="dynamo")._own, ft.compiler.DynamoRunner)
    with pytest.raises(ValueError, match="capture='direct'"):
        ft.compile(mlp[0], capture="direct", fullgraph=False)
    with pytest.raises(ValueError, match="capture must be one of"):
        ft.compile(mlp[0], capture="fast")
    with pytest.warns(DeprecationWarning, match="capture='direct'"):  # the old name still means the direct path
        assert isinstance(ft.compile(mlp[0], capture="flat")._own, ft.compiler.Runner)


@settings(max_examples=5, deadline=None)
@given(n=st.integers(1, 6), seed=st.sampled_from([None, 0, 7]))
def test_law_compiled_equals_eager_and_never_recompiles(mlp, n, seed):
    step, cstep, params, buffers, batches = mlp
    before = cstep.compiles
    e = c = step.init(fresh(params), buffers, seed=seed)
    for b in batches[:n]:
        e, em = step(e, b)
        c, cm = cstep(c, b)
        assert T.tree_allclose(e, c, rtol=1e-5, atol=1e-6)
        assert T.tree_allclose(em, cm, rtol=1e-5, atol=1e-6)
    assert cstep.compiles == before == 1


def test_twenty_steps_one_graph_and_pure(mlp):
    step, cstep, params, buffers, batches = mlp
    state = step.init(fresh(params), buffers)
    before = T.tree_map(torch.clone, state)
    s = state
    for i in range(20):
        s, _ = cstep(s, batches[i % len(batches)])
    assert cstep.compiles == 1
    assert T.tree_equal(state, before), "the compiled step wrote into its input"
    a, b = cstep(state, batches[0]), cstep(state, batches[0])
    assert T.tree_equal(a, b)


def test_guard_shape_change_compiles_once_more_and_switching_back_reuses():
    step, params, buffers, batches = problem()
    cstep = ft.compile(step, backend="aot_eager")
    s = step.init(fresh(params), buffers)
    s, _ = cstep(s, batches[0])
    short = (batches[1][0][:5], batches[1][1][:5])
    got, _ = cstep(s, short)
    assert cstep.compiles == 2
    want, _ = step(s, short)
    assert T.tree_allclose(got, want, rtol=1e-5, atol=1e-6)
    cstep(got, batches[2])
    cstep(got, short)
    assert cstep.compiles == 2, "a signature seen before compiled again"


@pytest.mark.parametrize("change", ["dtype", "stride", "structure", "leaf_shape", "batch_value", "batch_structure"])
def test_guard_any_change_recompiles_or_raises_never_a_wrong_result(change):
    step, params, buffers, batches = problem()
    cstep = ft.compile(step, backend="aot_eager")
    s0 = step.init(fresh(params), buffers)
    s1, _ = cstep(s0, batches[0])
    x, y = batches[1]
    state, batch = s1, (x, y)
    if change == "dtype":
        state = s1._replace(params=T.tree_map(lambda p: p.double(), s1.params),
                            opt_state=T.tree_map(lambda t: t.double() if t.is_floating_point() else t, s1.opt_state))
        batch = (x.double(), y.double())
    elif change == "stride":  # same shape, transposed layout
        w = s1.params["0.weight"]
        state = s1._replace(params={**s1.params, "0.weight": w.t().contiguous().t()})
    elif change == "structure":
        state = s1._replace(params={**s1.params, "extra": torch.zeros(2)})
    elif change == "leaf_shape":
        state = s1._replace(params={**s1.params, "0.bias": torch.zeros(3)})
    elif change == "batch_value":
        batch = {"x": x, "y": y}  # a different container
    elif change == "batch_structure":
        batch = (x, y, x)
    try:
        eager = step(state, batch)
    except Exception as e:  # noqa: BLE001 - the step itself rejects it: so must the compiled step
        with pytest.raises(type(e)):
            cstep(state, batch)
        return
    got = cstep(state, batch)
    assert cstep.compiles == 2, f"{change}: no new capture for a changed signature"
    assert T.tree_allclose(got, eager, rtol=1e-5, atol=1e-6)


def test_guard_python_scalar_in_the_batch_is_part_of_the_signature():
    w = {"w": torch.ones(3)}
    step = ft.train_step(lambda p, b, batch: (p["w"] * batch[0]).sum() * batch[1], ft.optim.sgd(0.1))
    cstep = ft.compile(step, backend="aot_eager")
    s = step.init(w)
    x = torch.arange(3.0)
    for k in (2.0, 3.0, 2.0):
        got, gm = cstep(s, (x, k))
        want, wm = step(s, (x, k))
        assert T.tree_allclose(got, want) and T.tree_allclose(gm, wm)
    assert cstep.compiles == 2


def test_guard_bad_inputs_keep_their_clear_errors(mlp):
    step, cstep, params, buffers, batches = mlp
    s = step.init(fresh(params), buffers)
    with pytest.raises(TypeError, match="TrainState"):
        cstep({"params": s.params}, batches[0])
    with pytest.raises(TypeError, match="batch must be a pytree"):
        cstep(s, (batches[0][0], "text"))


def test_donation_invalidates_the_donated_state():
    step, params, buffers, batches = problem()
    step = ft.ema(0.9, warmup=False)(step)
    state = step.init(fresh(params), buffers)
    expected = state
    for b in batches[:4]:
        expected, _ = step(expected, b)
    cstep = ft.compile(step, backend="aot_eager", donate=True)
    s = donating_loop(cstep, state, batches[:4], refused_by=(step,), emptied=True)
    assert T.tree_allclose(expected, s, rtol=1e-5, atol=1e-6)
    assert cstep.compiles == 1


def test_owned_donation_writes_in_place_and_the_old_state_cannot_step():
    step, params, buffers, batches = problem()
    cstep = ft.compile(step, backend="aot_eager")
    run = cstep.runner(donate=True)
    assert cstep.runner(donate=True) is not run and cstep.runner(donate=True).graphs is run.graphs  # a runner each; one graph cache
    state = step.init(fresh(params), buffers)
    expected = state
    for b in batches[:3]:
        expected, _ = step(expected, b)
    # every leaf but the host rng key (new each step) is written in place
    s = donating_loop(run, state, batches[:3], refused_by=(cstep,), leaves=lambda s: s._replace(rng=None))
    assert T.tree_allclose(expected, s, rtol=1e-5, atol=1e-6)
    assert cstep.compiles == 1  # the donating graph; the pure one was never needed


def test_run_donates_by_default_and_leaves_the_callers_state_alone():
    step, params, buffers, batches = problem()
    cstep = ft.compile(step, backend="aot_eager")
    state = step.init(fresh(params), buffers)
    before = T.tree_map(torch.clone, state)
    # ft.run compiles in the background: its trace waits for the compiler's imports (a thread), which on a loaded
    # machine can outlast these few steps; the test waits for them (an event), not for a time
    from functrain.compiler.capture import preload, wait_for_imports
    preload()
    wait_for_imports()
    got = ft.run(cstep, state, batches, progress=False)
    assert T.tree_equal(state, before), "ft.run wrote into the state it was given"
    want = ft.run(step, state, batches, progress=False)
    assert T.tree_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert cstep.compiles == 1
    again = ft.run(cstep, got, batches, progress=False, donate=False)
    assert cstep.compiles == 2  # the pure graph
    assert T.tree_allclose(again, ft.run(step, got, batches, progress=False), rtol=1e-5, atol=1e-6)
    with pytest.raises(TypeError, match="donate must be a bool"):
        ft.run(cstep, state, batches, donate="yes")


def test_rng_skipped_without_random_ops_and_exact_with_them():
    step, params, buffers, batches = problem(dropout=0.0)
    cstep = ft.compile(step, backend="aot_eager")
    s = step.init(fresh(params), buffers, seed=3)
    g = torch.get_rng_state()
    out, _ = cstep(s, batches[0])
    assert cstep._own.last.random is False
    assert torch.equal(torch.get_rng_state(), g)
    assert T.tree_equal(out.rng, step(s, batches[0])[0].rng), "the RNG counter did not advance as eagerly"

    dstep, dparams, dbuffers, dbatches = problem(dropout=0.5)
    dc = ft.compile(dstep, backend="aot_eager")
    e = c = dstep.init(fresh(dparams), dbuffers, seed=3)
    g = torch.get_rng_state()
    for b in dbatches[:4]:
        e, em = dstep(e, b)
        c, cm = dc(c, b)
        assert T.tree_allclose(e, c, rtol=1e-5, atol=1e-6), "dropout masks differ from the eager step's"
        torch.testing.assert_close(em["loss"], cm["loss"])
    assert dc._own.last.random is True
    assert torch.equal(torch.get_rng_state(), g), "the caller's generator was not restored"
    # a different seed draws different masks
    other, _ = dc(dstep.init(fresh(dparams), dbuffers, seed=4), dbatches[0])
    first, _ = dc(dstep.init(fresh(dparams), dbuffers, seed=3), dbatches[0])
    assert not T.tree_allclose(other.params, first.params)


def test_draws_random_reads_the_graph():
    from torch.fx.experimental.proxy_tensor import make_fx
    assert draws_random(make_fx(lambda x: torch.nn.functional.dropout(x, 0.5))(torch.ones(3)))
    assert draws_random(make_fx(lambda x: x + torch.randn(3))(torch.ones(3)))
    assert not draws_random(make_fx(lambda x: (x * 2).relu())(torch.ones(3)))


def test_errors_on_the_fast_path():
    def breaks(params, buffers, x):
        loss = (params["w"] * x).sum()
        if loss > 0:  # a Python branch on a tensor value
            return loss
        return -loss

    step = ft.train_step(breaks, ft.optim.sgd(0.1))
    with pytest.raises(ft.GraphBreakError, match="fullgraph=True"):
        ft.compile(step, backend="aot_eager")(step.init({"w": torch.ones(3)}), torch.ones(3))

    def bad_loss(params, buffers, x):
        return params["w"] * x  # not a scalar

    step = ft.train_step(bad_loss, ft.optim.sgd(0.1))
    with pytest.raises(ValueError, match="scalar loss"):
        ft.compile(step, backend="aot_eager")(step.init({"w": torch.ones(3)}), torch.ones(3))

    def raises(params, buffers, x):
        raise KeyError("no such feature: 'pixels'")

    step = ft.train_step(raises, ft.optim.sgd(0.1))
    with pytest.raises(KeyError, match="pixels"):
        ft.compile(step, backend="aot_eager")(step.init({"w": torch.ones(3)}), torch.ones(3))


def test_a_closed_over_tensor_is_read_at_call_time():
    scale = torch.tensor(2.0)
    step = ft.train_step(lambda p, b, x: (p["w"] * x * scale).sum(), ft.optim.sgd(0.1))
    cstep = ft.compile(step, backend="aot_eager")
    s = step.init({"w": torch.ones(3)})
    cstep(s, torch.ones(3))
    scale.fill_(5.0)  # changed in place, as a user might (a schedule held in a tensor)
    got, _ = cstep(s, torch.ones(3))
    want, _ = step(s, torch.ones(3))
    assert T.tree_allclose(got, want)
    assert cstep.compiles == 1


def test_inductor_fast_path_matches_eager_and_donates():
    step, params, buffers, batches = problem()
    step = ft.clip(1.0)(ft.ema(0.9, warmup=False)(step))
    cstep = ft.compile(step)
    run = cstep.runner(donate=True)
    e = step.init(fresh(params), buffers)
    c = T.tree_map(torch.clone, e)
    for i in range(8):
        b = batches[i % len(batches)]
        e, em = step(e, b)
        c, cm = run(c, b)
    assert T.tree_allclose(e, c, rtol=1e-5, atol=1e-6)
    assert T.tree_allclose(em, cm, rtol=1e-5, atol=1e-6)
    assert cstep.compiles == 1


_REUSE_SCRIPT = r"""
import json, sys
import torch
import functrain as ft
from torch._dynamo.utils import counters
torch.manual_seed(0)
scale = float(sys.argv[1])
model = torch.nn.Linear(4, 1)
apply_fn, params, buffers = ft.functionalize(model)
def loss_fn(params, buffers, batch):
    x, y = batch
    return scale * torch.nn.functional.mse_loss(apply_fn(params, buffers, x), y)
step = ft.train_step(loss_fn, ft.optim.adamw(1e-2))
batch = (torch.randn(8, 4), torch.randn(8, 1))
state = step.init(params, buffers)
got, _ = ft.compile(step)(state, batch)
want, _ = step(state, batch)
print(json.dumps({"hit": counters["inductor"]["fxgraph_cache_hit"], "miss": counters["inductor"]["fxgraph_cache_miss"],
                  "bypass": counters["inductor"]["fxgraph_cache_bypass"],
                  "aot_hit": counters["aot_autograd"]["autograd_cache_hit"],
                  "equal": bool(ft.tree.tree_allclose(got, want, rtol=1e-5, atol=1e-6))}))
"""


def test_a_second_process_reuses_the_compile_and_a_changed_loss_does_not(tmp_path):
    """The capture hands inductor a graph it can cache (a shape environment, as Dynamo gives):
    a second process with the same on-disk cache loads AOTAutograd's and inductor's entries
    instead of compiling, and a changed loss function misses (its graph differs) and is right."""
    import json
    import os
    import subprocess
    import sys
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor"), "OMP_NUM_THREADS": "1"}

    def run(scale):
        out = subprocess.run([sys.executable, "-c", _REUSE_SCRIPT, str(scale)], env=env, capture_output=True,
                             text=True, timeout=600)
        assert out.returncode == 0, out.stderr[-3000:]
        return json.loads(out.stdout.strip().splitlines()[-1])

    first = run(1.0)
    assert first["bypass"] == 0 and first["miss"] == 1 and first["equal"], first
    second = run(1.0)
    assert second["hit"] == 1 and second["miss"] == 0 and second["aot_hit"] == 1 and second["equal"], second
    changed = run(3.0)
    assert changed["miss"] == 1 and changed["hit"] == 0 and changed["equal"], changed


def test_inductor_fast_path_with_accumulate_clip_ema():
    """accumulate(n) splits the batch inside the graph: compiled with static shapes (a regression:
    a symbolic size from the compile's shape environment once broke inductor's scalar pass)."""
    step, params, buffers, batches = problem()
    step = ft.ema(0.99, warmup=False)(ft.clip(1.0)(ft.accumulate(3)(step)))
    big = [(torch.cat([b[0]] * 3), torch.cat([b[1]] * 3)) for b in batches[:3]]
    ftt_state = step.init(fresh(params), buffers)
    cstep = ft.compile(step)
    e = c = ftt_state
    for b in big:
        e, em = step(e, b)
        c, cm = cstep(c, b)
    assert T.tree_allclose(e, c, rtol=1e-5, atol=1e-6)
    assert T.tree_allclose(em, cm, rtol=1e-5, atol=1e-6)
    assert cstep.compiles == 1
