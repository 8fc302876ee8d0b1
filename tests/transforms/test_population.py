"""ft.population: n members of a step trained as one vmapped step (issue 39).

The law: member i of a population equals a single run of the inner step from member i's initial state (its
seed), step for step, for every built-in transform, eager and compiled. Tolerance: the population's per-member
ops are the batched forms of the single run's (a batched matmul, per-tensor loops for the foreach ops), which
round differently in the last bits: allclose rtol = atol = 1e-5 over a few steps (a wrong member, a norm taken
over the whole population, a loss scale shared by the members are off by O(1)). Bitwise where it holds: see
test_bitwise_where_the_ops_are_the_same.
"""
from __future__ import annotations

import math

import optree
import pytest
import torch
from hypothesis import given, settings, strategies as st

import functrain as ft

FAST = settings(deadline=None, max_examples=12)
TOL = dict(rtol=1e-5, atol=1e-5)


def make_model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.Tanh(), torch.nn.Linear(5, 2))


APPLY, _, _ = ft.functionalize(make_model(0))


def loss_fn(params, buffers, batch):
    x, y = batch
    return torch.nn.functional.mse_loss(APPLY(params, buffers, x), y)


def init_params(seed: int) -> dict:
    return ft.functionalize(make_model(seed))[1]


TRANSFORMS = {
    "clip": lambda: ft.clip(0.05),
    "ema": lambda: ft.ema(0.9, warmup=False),
    "skip_nonfinite": lambda: ft.skip_nonfinite(),
    "accumulate": lambda: ft.accumulate(2),
}
OPTIMIZERS = {
    "sgd": lambda: ft.optim.sgd(0.1, momentum=0.9),
    "adamw": lambda: ft.optim.adamw(1e-2, weight_decay=0.1),
}


def build(opt: str, names: list[str]) -> ft.Step:
    step = ft.train_step(loss_fn, OPTIMIZERS[opt]())
    for name in names:
        step = TRANSFORMS[name]()(step)
    return step


def batches(seed: int, steps: int, n: int | None, rows: int = 4) -> list:
    g = torch.Generator().manual_seed(seed)
    lead = () if n is None else (n,)
    return [(torch.randn(*lead, rows, 3, generator=g), torch.randn(*lead, rows, 2, generator=g)) for _ in range(steps)]


def parts(state):
    return (state.params, state.buffers, state.opt_state, state.slots)


def assert_member_equals(pop_state, i, single, **tol):
    got = parts(ft.member(pop_state, i))
    want = parts(single)
    assert optree.tree_structure(got) == optree.tree_structure(want)
    for a, b in zip(optree.tree_leaves(got), optree.tree_leaves(want)):
        if tol:
            torch.testing.assert_close(a, b, **tol)
        else:
            assert torch.equal(a, b)


def single_runs(step, seeds, data, per_member):
    out = []
    for i, seed in enumerate(seeds):
        s = step.init(init_params(seed), seed=None)
        for b in data:
            s, _ = step(s, tuple(x[i] for x in b) if per_member else b)
        out.append(s)
    return out


# -- the law, eager ---------------------------------------------------------------------------
@FAST
@given(opt=st.sampled_from(sorted(OPTIMIZERS)),
       names=st.lists(st.sampled_from(sorted(TRANSFORMS)), unique=True, max_size=4),
       seeds=st.lists(st.integers(0, 1000), min_size=1, max_size=4),
       per_member=st.booleans(), data_seed=st.integers(0, 2**16))
def test_member_i_equals_a_single_run_with_its_seed(opt, names, seeds, per_member, data_seed):
    step = build(opt, names)
    n = len(seeds)
    pop = ft.population(n, batch="per_member" if per_member else "shared")(step)
    state = pop.init(init_params, seeds=seeds)
    data = batches(data_seed, 3, n if per_member else None)
    for b in data:
        state, metrics = pop(state, b)
    assert metrics["loss"].shape == (n,)
    assert int(state.step) == 3
    for i, single in enumerate(single_runs(step, seeds, data, per_member)):
        assert_member_equals(state, i, single, **TOL)


HYPER = st.fixed_dictionaries({
    "lr": st.floats(1e-4, 5e-2), "weight_decay": st.floats(0.0, 0.3), "max_norm": st.floats(0.01, 2.0),
    "decay": st.floats(0.5, 0.999)})


def hyper_of(h: dict) -> dict:
    return {"lr": h["lr"], "weight_decay": h["weight_decay"], "clip": {"max_norm": h["max_norm"]},
            "ema": {"decay": h["decay"]}}


@FAST
@given(members=st.lists(st.tuples(st.integers(0, 1000), HYPER), min_size=1, max_size=4),
       data_seed=st.integers(0, 2**16))
def test_member_i_equals_a_single_run_with_its_hyper_parameters(members, data_seed):
    """Per-member lr, weight decay, clip norm and EMA decay (ft.set_hyper with tensors of shape (n,)): member i
    equals the single run with its seed and its values."""
    step = build("adamw", ["clip", "ema"])
    n = len(members)
    pop = ft.population(n, batch="shared")(step)
    state = pop.init(init_params, seeds=[s for s, _ in members])
    stacked = {k: torch.tensor([h[k] for _, h in members], dtype=torch.float64) for k in HYPER_KEYS}
    state = ft.set_hyper(state, **hyper_of(stacked))
    data = batches(data_seed, 3, None)
    for b in data:
        state, metrics = pop(state, b)
    torch.testing.assert_close(metrics["lr"], stacked["lr"])
    for i, (seed, h) in enumerate(members):
        single = ft.set_hyper(step.init(init_params(seed), seed=None), **hyper_of(h))
        for b in data:
            single, _ = step(single, b)
        assert_member_equals(state, i, single, **TOL)


HYPER_KEYS = ("lr", "weight_decay", "max_norm", "decay")


def test_the_reference_discriminates():
    """The law's check fails for a wrong member: members with different seeds end apart by far more than TOL."""
    step = build("adamw", ["clip"])
    pop = ft.population(2, batch="shared")(step)
    state = pop.init(init_params, seeds=[1, 2])
    for b in batches(0, 2, None):
        state, _ = pop(state, b)
    single = single_runs(step, [2], batches(0, 2, None), False)[0]
    with pytest.raises(AssertionError):
        assert_member_equals(state, 0, single, **TOL)
    assert_member_equals(state, 1, single, **TOL)


def test_bitwise_where_the_ops_are_the_same():
    """Elementwise work (SGD on params that enter the loss elementwise) is bitwise a single run's: the batched
    kernels compute each member's elements with the same operations. (A matmul's batched kernel may sum in
    another order: there the law holds to rounding, as the test above checks.)"""
    step = ft.clip(0.5)(ft.train_step(lambda p, b, x: ((p["w"] - x) ** 2).sum(), ft.optim.sgd(0.1, momentum=0.9)))
    pop = ft.population(3, batch="shared")(step)
    state = pop.init(lambda seed: {"w": torch.randn(7, generator=torch.Generator().manual_seed(seed))},
                     seeds=[0, 1, 2])
    xs = [torch.randn(7) for _ in range(4)]
    for x in xs:
        state, _ = pop(state, x)
    for i in range(3):
        s = step.init({"w": torch.randn(7, generator=torch.Generator().manual_seed(i))}, seed=None)
        for x in xs:
            s, _ = step(s, x)
        assert_member_equals(state, i, s)  # bitwise


# -- each transform keeps its meaning per member ------------------------------------------------
def test_clip_uses_each_members_own_norm():
    """Member 0's gradient is tiny, member 1's huge: clipping by a norm over the whole population would shrink
    member 0's update; per member it is untouched."""
    step = ft.clip(1.0)(ft.train_step(lambda p, b, x: (p["w"] * x).sum(), ft.optim.sgd(1.0)))
    pop = ft.population(2, batch="per_member")(step)
    state = pop.init({"w": torch.zeros(2)})
    state, _ = pop(state, torch.tensor([[0.03, 0.04], [300.0, 400.0]]))
    torch.testing.assert_close(state.params["w"], torch.tensor([[-0.03, -0.04], [-0.6, -0.8]]))


def test_fp16_overflow_of_one_member_skips_only_its_update():
    step = ft.mixed_precision("fp16", init_scale=256.0)(
        ft.train_step(lambda p, b, x: (p["w"] * p["w"] * x).sum(), ft.optim.sgd(0.1)))
    pop = ft.population(2, batch="shared")(step)
    state = pop.stack([step.init({"w": torch.ones(2)}), step.init({"w": torch.full((2,), 1e4)})])
    scale0 = state.loss_scale.scale.clone()
    new, metrics = pop(state, torch.full((2,), 0.01))  # member 1: w * w = 1e8 overflows fp16
    assert metrics["skipped"].tolist() == [False, True]
    torch.testing.assert_close(new.params["w"][0], torch.full((2,), 1 - 0.1 * 2 * 0.01))  # updated
    assert torch.equal(new.params["w"][1], state.params["w"][1])                        # skipped: unchanged
    assert new.loss_scale.scale[0] == scale0[0] and new.loss_scale.scale[1] == scale0[1] / 2  # backoff: member 1
    assert new.opt_state.count.tolist() == [1, 0]
    alone, m = step(ft.member(state, 1), torch.full((2,), 0.01))  # the single run of member 1 skips alike
    assert bool(m["skipped"]) and alone.loss_scale.scale == new.loss_scale.scale[1]


def test_a_member_leaves_and_trains_alone():
    """ft.member gives an ordinary state: the inner step trains it on, equal to the member in the population."""
    step = build("adamw", ["ema", "clip"])
    pop = ft.population(3, batch="shared")(step)
    state = pop.init(init_params, seeds=[4, 5, 6])
    data = batches(1, 4, None)
    for b in data[:2]:
        state, _ = pop(state, b)
    alone = ft.member(state, 2)
    assert alone.params["0.weight"].shape == (5, 3) and alone.ema["0.weight"].shape == (5, 3)
    for b in data[2:]:
        state, _ = pop(state, b)
        alone, _ = step(alone, b)
    assert_member_equals(state, 2, alone, **TOL)
    assert ft.member(state, -1).params["0.bias"].equal(ft.member(state, 2).params["0.bias"])


def test_init_from_a_module_reinitialises_each_member_by_its_seed():
    model = make_model(0)
    apply_fn, _, _ = ft.functionalize(model)
    step = ft.train_step(lambda p, b, x: apply_fn(p, b, x).pow(2).mean(), ft.optim.sgd(0.1))
    pop = ft.population(3, batch="shared")(step)
    a, b = pop.init(model, seeds=[7, 8, 7]), pop.init(model, seeds=[7, 8, 7])
    w = a.params["0.weight"]
    assert torch.equal(w, b.params["0.weight"])               # a seed decides the member's init
    assert torch.equal(w[0], w[2]) and not torch.equal(w[0], w[1])
    assert not torch.equal(w[0], model[0].weight.detach())    # re-initialised, the module itself untouched
    same = pop.init(dict(ft.functionalize(model)[1]))         # a params tree: every member starts from it
    assert torch.equal(same.params["0.weight"][1], model[0].weight.detach())


def test_random_draws_differ_by_member_and_repeat_from_the_state():
    drop = ft.train_step(lambda p, b, x: torch.nn.functional.dropout(p["w"] * x, 0.5).sum(), ft.optim.sgd(0.1))
    pop = ft.population(4, batch="shared")(drop)
    state = pop.init({"w": torch.ones(64)}, seed=3)
    new, m = pop(state, torch.ones(64))
    again, m2 = pop(state, torch.ones(64))
    assert torch.equal(new.params["w"], again.params["w"])   # reproducible from the state's key
    rows = new.params["w"]
    assert not torch.equal(rows[0], rows[1])                 # each member its own mask
    same = ft.population(4, batch="shared", randomness="same")(drop)
    rows = same(same.init({"w": torch.ones(64)}, seed=3), torch.ones(64))[0].params["w"]
    assert torch.equal(rows[0], rows[3])
    refused = ft.population(4, batch="shared", randomness="error")(drop)
    with pytest.raises(ft.PopulationError, match="randomness"):
        refused(refused.init({"w": torch.ones(64)}), torch.ones(64))


@pytest.mark.parametrize("batch", ["shared", "per_member"])
def test_a_compiled_population_with_dropout_draws_the_eager_populations_masks(batch):
    """A model with nn.Dropout compiles as a population (the trace's CPU dropout draws its mask into a tensor that
    is batched under vmap, so vmap's randomness="different" accepts it) and draws what the eager population draws,
    every member its own mask, in one graph."""
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Dropout(0.5), torch.nn.Linear(8, 1))
    apply_fn, _, _ = ft.functionalize(model)
    step = ft.train_step(lambda p, b, xy: torch.nn.functional.mse_loss(apply_fn(p, b, xy[0]), xy[1]),
                         ft.optim.adamw(1e-2))
    pop = ft.population(3, batch=batch)(step)
    state = pop.init(model, seeds=[0, 0, 0])  # the same init: only the members' masks tell them apart
    lead = (3,) if batch == "per_member" else ()
    xy = (torch.ones(*lead, 16, 8), torch.zeros(*lead, 16, 1))
    eager, e_metrics = pop(state, xy)
    cstep = ft.compile(pop, backend="aot_eager")
    compiled, c_metrics = cstep(state, xy)
    for a, b in zip(optree.tree_leaves(compiled.params), optree.tree_leaves(eager.params)):
        torch.testing.assert_close(a, b, **TOL)
    torch.testing.assert_close(c_metrics["loss"], e_metrics["loss"], **TOL)
    w = compiled.params["2.weight"]
    assert not torch.equal(w[0], w[1]) and not torch.equal(w[1], w[2])  # each member its own mask
    again, _ = cstep(compiled, xy)
    assert cstep.compiles == 1


# -- refusals, before step 1 -------------------------------------------------------------------
class HostRead(ft.Transform):
    name = "host_read"

    def transform(self, ctx):
        if float(ft.tree.global_norm(ctx.grads)) > 1e9:  # a host read: fine eagerly, not under vmap
            ctx.grads = ft.tree.tree_scale(ctx.grads, 0.0)


def test_refusals_name_what_cannot_be_vmapped():
    step = ft.train_step(lambda p, b, x: (p["w"] * x).sum(), ft.optim.sgd(0.1))
    pop = ft.population(2, batch="shared")(HostRead()(step))
    state = pop.init({"w": torch.ones(2)})
    with pytest.raises(ft.PopulationError, match=r"transform 'host_read' \(HostRead.transform\)"):
        pop(state, torch.ones(2))
    with pytest.raises(ft.PopulationError, match="batch must be 'shared'.*got 'both'"):
        ft.population(2, batch="both")(step)
    with pytest.raises(TypeError, match="batch"):
        ft.population(2)(step)  # the batch is chosen explicitly
    with pytest.raises(ft.PopulationError, match="n must be an int >= 1.*got 0"):
        ft.population(0, batch="shared")
    per = ft.population(2, batch="per_member")(step)
    with pytest.raises(ft.PopulationError, match=r"batch leaf .* has shape \(3, 2\).*leading axis of 2"):
        per(per.init({"w": torch.ones(2)}), torch.ones(3, 2))
    with pytest.raises(ft.PopulationError, match=r"state.params\['w'\] has shape \(3,\)"):
        pop(step.init({"w": torch.ones(3)}), torch.ones(3))
    with pytest.raises(ft.PopulationError, match="3 seeds for a population of 2"):
        pop.init({"w": torch.ones(2)}, seeds=[1, 2, 3])
    with pytest.raises(ft.PopulationError, match=r"i must be an int in \[0, 2\).*got 2"):
        ft.member(state, 2)


def test_sharded_data_parallel_is_refused_by_name():
    step = ft.train_step(lambda p, b, x: (p["w"] * x).sum(), ft.optim.sgd(0.1))
    with pytest.raises(ft.PopulationError, match="'data_parallel'.*shards the state over processes"):
        ft.population(2, batch="shared")(ft.data_parallel(shard="optimizer")(step))
    with pytest.raises(ft.PopulationError, match="'data_parallel'.*shards"):  # applied after: the same refusal
        ft.data_parallel(shard="optimizer")(ft.population(2, batch="shared")(step))


def _dp_population_rank(compiled: bool, seeds: list, data: list) -> list:
    """One rank of a data-parallel population: its half of every batch's rows; the members' params after."""
    import torch.distributed as dist

    step = ft.data_parallel()(build("adamw", ["clip", "ema"]))
    pop = ft.population(len(seeds), batch="per_member")(step)
    state = pop.init(init_params, seeds=seeds)
    # (aot_eager: the same captured graph, the collectives and the vmap traced into it, without inductor's
    # codegen on two loaded ranks; the inductor-compiled population is tested in one process below)
    run = ft.compile(pop, backend="aot_eager") if compiled else pop
    rank, world = dist.get_rank(), dist.get_world_size()
    mine = [(x.chunk(world, dim=1)[rank], y.chunk(world, dim=1)[rank]) for x, y in data]
    collectives = None
    if compiled:  # the graph all-reduces the whole population at once: one collective, not one per member
        cap = run._own.graphs.trace(state._replace(rng=None), state, mine[0])
        collectives = sum("all_reduce" in str(node.target) for node in cap.gm.graph.nodes)
    for b in mine:
        state, metrics = run(state, b)
    return [parts(ft.member(state, i)) for i in range(len(seeds))] + [metrics["loss"], collectives]


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_data_parallel_population_on_two_processes_equals_single_runs(compiled):
    """Each rank holds every member and steps on half of each member's rows; the members' gradients are
    all-reduced (one collective for the population): member i equals its single run on the whole batch."""
    seeds, data = [3, 4, 5], batches(7, 3, 3, rows=8)
    results = ft.launch(_dp_population_rank, nprocs=2, args=(compiled, seeds, data), timeout=500)
    step = build("adamw", ["clip", "ema"])
    singles = single_runs(step, seeds, data, True)
    for got in results:  # both ranks hold the same population
        for i, single in enumerate(singles):
            for a, b in zip(optree.tree_leaves(got[i]), optree.tree_leaves(parts(single))):
                torch.testing.assert_close(a, b, **TOL)
    torch.testing.assert_close(results[0][-2], results[1][-2], rtol=0, atol=0)
    if compiled:
        assert results[0][-1] == 1, results[0][-1]  # one float32 buffer for every member's grads and metrics


# -- checkpoints: the population is the pytree --------------------------------------------------
def test_checkpoint_saves_and_resumes_the_population_bit_exactly(tmp_path):
    step = ft.mixed_precision("fp16")(build("adamw", ["ema", "accumulate"]))
    pop = ft.population(3, batch="per_member")(step)
    state = pop.init(init_params, seeds=[0, 1, 2], seed=5)
    data = batches(2, 4, 3)
    for b in data[:2]:
        state, _ = pop(state, b)
    ft.save(tmp_path / "ckpt", state)
    loaded = ft.load(tmp_path / "ckpt", pop.init(init_params, seeds=[9, 9, 9], seed=1))
    for a, b in zip(optree.tree_leaves(state), optree.tree_leaves(loaded)):
        assert a.dtype == b.dtype and torch.equal(a, b)
    for b in data[2:]:
        state, _ = pop(state, b)
        loaded, _ = pop(loaded, b)
    for a, b in zip(optree.tree_leaves(state), optree.tree_leaves(loaded)):
        assert torch.equal(a, b)


# -- compiled: one graph, no recompile, equal to eager ------------------------------------------
@pytest.fixture(scope="module")
def compiled():
    step = build("adamw", ["clip", "ema", "skip_nonfinite"])
    pop = ft.population(4, batch="per_member")(step)
    cstep = ft.compile(pop)
    state = pop.init(init_params, seeds=[0, 1, 2, 3])
    cstep(state, batches(0, 1, 4)[0])  # compile once for the module
    return step, pop, cstep


@settings(deadline=None, max_examples=6)
@given(seeds=st.lists(st.integers(0, 1000), min_size=4, max_size=4), data_seed=st.integers(0, 2**16))
def test_compiled_population_equals_eager_and_single_runs(compiled, seeds, data_seed):
    step, pop, cstep = compiled
    before = cstep.compiles
    data = batches(data_seed, 3, 4)
    lrs = torch.tensor([1e-3, 3e-3, 1e-2, 3e-2], dtype=torch.float64)[torch.randperm(4)]
    eager = c = ft.set_hyper(pop.init(init_params, seeds=seeds), lr=lrs)  # values: inputs of the one graph
    for b in data:
        c, cm = cstep(c, b)
        eager, em = pop(eager, b)
    assert cstep.compiles == before == 1  # one graph, no recompile as steps and states go by
    for a, b in zip(optree.tree_leaves(c), optree.tree_leaves(eager)):
        torch.testing.assert_close(a, b, **TOL)
    torch.testing.assert_close(cm["loss"], em["loss"], **TOL)
    for i, seed in enumerate(seeds):
        single = ft.set_hyper(step.init(init_params(seed), seed=None), lr=float(lrs[i]))
        for x, y in data:
            single, _ = step(single, (x[i], y[i]))
        assert_member_equals(c, i, single, **TOL)
