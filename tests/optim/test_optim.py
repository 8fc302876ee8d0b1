"""Tests for functrain.optim: parity with torch.optim, purity, schedules, compile, validation."""
from __future__ import annotations

import optree
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from functrain.optim import AdamState, SGDState, adam, adamw, schedules, sgd

STEPS = 50
ATOL = 1e-6


def make_params(seed: int = 0, shapes=None) -> dict:
    gen = torch.Generator().manual_seed(seed)
    if shapes is None:
        shapes = {"w1": (5, 4), "b1": (4,), "block": {"w2": (3, 2, 2), "scale": ()}}
    return optree.tree_map(lambda s: torch.randn(s, generator=gen), shapes, is_leaf=lambda x: isinstance(x, tuple))


def make_grads(params: dict, steps: int = STEPS, seed: int = 1) -> list:
    gen = torch.Generator().manual_seed(seed)
    return [optree.tree_map(lambda p: torch.randn(p.shape, generator=gen), params) for _ in range(steps)]


def run_torch(opt_cls, kwargs, params, grads, lr_lambda=None):
    """Run torch.optim from ``params``; with ``lr_lambda``, base lr 1.0 and LambdaLR(lr_lambda)."""
    leaves, spec = optree.tree_flatten(params)
    ps = [torch.nn.Parameter(p.clone()) for p in leaves]
    opt = opt_cls(ps, **kwargs)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda) if lr_lambda is not None else None
    lrs = []
    for g in grads:
        lrs.append(opt.param_groups[0]["lr"])
        for p, gl in zip(ps, spec.flatten_up_to(g)):
            p.grad = gl.clone()
        opt.step()
        if sched is not None:
            sched.step()
    return optree.tree_unflatten(spec, [p.detach() for p in ps]), lrs


def run_functional(opt, params, grads):
    state = opt.init(params)
    lrs = []
    for g in grads:
        lrs.append(float(opt.learning_rate(state)))
        params, state = opt.update(g, state, params)
    return params, state, lrs


def max_err(a, b) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(optree.tree_leaves(a), optree.tree_leaves(b)))


def assert_tree_close(actual, expected, atol=ATOL):
    la, sa = optree.tree_flatten(actual)
    le, se = optree.tree_flatten(expected)
    assert sa == se
    for x, y in zip(la, le):
        torch.testing.assert_close(x, y, rtol=0, atol=atol)


def bits_equal(a, b) -> bool:
    la, sa = optree.tree_flatten(a)
    lb, sb = optree.tree_flatten(b)
    if sa != sb:
        return False
    for x, y in zip(la, lb):
        if x.dtype != y.dtype or x.shape != y.shape:
            return False
        if x.is_floating_point():
            ints = {8: torch.int64, 4: torch.int32, 2: torch.int16}[x.element_size()]
            x, y = x.contiguous().view(ints), y.contiguous().view(ints)
        if not torch.equal(x, y):
            return False
    return True


CASES = {
    "sgd": (sgd, torch.optim.SGD, dict(lr=0.05)),
    "sgd_momentum": (sgd, torch.optim.SGD, dict(lr=0.05, momentum=0.9)),
    "sgd_nesterov": (sgd, torch.optim.SGD, dict(lr=0.05, momentum=0.9, nesterov=True)),
    "sgd_wd": (sgd, torch.optim.SGD, dict(lr=0.05, momentum=0.8, weight_decay=0.1)),
    "sgd_dampening": (sgd, torch.optim.SGD, dict(lr=0.05, momentum=0.9, dampening=0.3, weight_decay=0.01)),
    "sgd_nesterov_wd": (sgd, torch.optim.SGD, dict(lr=0.03, momentum=0.7, nesterov=True, weight_decay=0.05)),
    "adam": (adam, torch.optim.Adam, dict(lr=1e-2)),
    "adam_wd": (adam, torch.optim.Adam, dict(lr=1e-2, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1)),
    "adamw": (adamw, torch.optim.AdamW, dict(lr=1e-2)),
    "adamw_wd": (adamw, torch.optim.AdamW, dict(lr=3e-2, betas=(0.85, 0.95), weight_decay=0.2)),
}


@pytest.mark.parametrize("name", list(CASES))
def test_parity_with_torch_optim(name):
    ours, theirs, kwargs = CASES[name]
    params = make_params()
    grads = make_grads(params)
    expected, _ = run_torch(theirs, kwargs, params, grads)
    actual, state, _ = run_functional(ours(**kwargs), params, grads)
    assert int(state.count) == STEPS and state.count.dtype == torch.int64
    assert_tree_close(actual, expected)


def _lambda(schedule):
    return lambda t: float(schedule(t))


SCHEDULE_CASES = {
    "sgd_momentum": (sgd, torch.optim.SGD, dict(momentum=0.9, weight_decay=0.01)),
    "sgd_dampening": (sgd, torch.optim.SGD, dict(momentum=0.9, dampening=0.5)),
    "adam": (adam, torch.optim.Adam, dict(weight_decay=0.05)),
    "adamw": (adamw, torch.optim.AdamW, dict(weight_decay=0.1)),
}


@pytest.mark.parametrize("name", list(SCHEDULE_CASES))
def test_parity_with_lambda_lr_schedule(name):
    ours, theirs, kwargs = SCHEDULE_CASES[name]
    sched = schedules.warmup_cosine(0.05, warmup_steps=10, total_steps=40, final=0.005)
    params = make_params(seed=3)
    grads = make_grads(params, seed=4)
    expected, torch_lrs = run_torch(theirs, dict(lr=1.0, **kwargs), params, grads, lr_lambda=_lambda(sched))
    actual, _, our_lrs = run_functional(ours(lr=sched, **kwargs), params, grads)
    assert our_lrs == pytest.approx(torch_lrs, rel=0, abs=1e-15)
    assert our_lrs[0] == 0.0 and our_lrs[10] == pytest.approx(0.05) and our_lrs[-1] == pytest.approx(0.005)
    assert_tree_close(actual, expected)


_shapes = st.lists(st.lists(st.integers(1, 4), min_size=0, max_size=3).map(tuple), min_size=1, max_size=3)


@settings(max_examples=15, deadline=None)
@given(
    shapes=_shapes,
    lr=st.floats(1e-4, 0.1),
    beta1=st.floats(0.0, 0.99),
    beta2=st.floats(0.5, 0.9999),
    wd=st.sampled_from([0.0, 1e-3, 0.1]),
    momentum=st.floats(0.0, 0.99),
    seed=st.integers(0, 2**16),
)
def test_property_parity_adamw_and_sgd_momentum(shapes, lr, beta1, beta2, wd, momentum, seed):
    params = make_params(seed, {f"p{i}": s for i, s in enumerate(shapes)})
    grads = make_grads(params, steps=10, seed=seed + 1)
    kw = dict(lr=lr, betas=(beta1, beta2), weight_decay=wd)
    expected, _ = run_torch(torch.optim.AdamW, kw, params, grads)
    actual, _, _ = run_functional(adamw(**kw), params, grads)
    assert_tree_close(actual, expected)
    kw = dict(lr=lr, momentum=momentum, weight_decay=wd)
    expected, _ = run_torch(torch.optim.SGD, kw, params, grads)
    actual, _, _ = run_functional(sgd(**kw), params, grads)
    assert_tree_close(actual, expected)


@pytest.mark.parametrize(
    "opt",
    [
        sgd(lr=0.1),
        sgd(lr=0.1, momentum=0.9, dampening=0.2, weight_decay=0.1),
        sgd(lr=schedules.linear_warmup(0.1, 3, start=0.01), momentum=0.9, nesterov=True),
        adam(lr=0.1, weight_decay=0.1),
        adamw(lr=schedules.cosine_decay(0.1, 10), weight_decay=0.1),
    ],
    ids=["sgd", "sgd_momentum", "sgd_nesterov_sched", "adam_wd", "adamw_sched"],
)
def test_update_is_pure(opt):
    params = make_params()
    grads = make_grads(params, steps=3)
    state = opt.init(params)
    for g in grads:  # several steps, so the state is non-trivial
        snapshot = optree.tree_map(torch.clone, (g, state, params))
        new_params, new_state = opt.update(g, state, params)
        assert bits_equal((g, state, params), snapshot)
        assert not bits_equal(new_params, params)
        assert type(new_state) is type(state) and int(new_state.count) == int(state.count) + 1
        params, state = new_params, new_state


def test_state_layout():
    params = make_params()
    s = sgd(lr=0.1).init(params)
    assert isinstance(s, SGDState) and s.momentum_buffer is None
    assert s.count.dtype == torch.int64 and s.count.shape == () and int(s.count) == 0
    a = adamw(lr=0.1).init(params)
    assert isinstance(a, AdamState)
    assert optree.tree_structure(a.exp_avg) == optree.tree_structure(params)
    assert all(float(x.abs().sum()) == 0 for x in optree.tree_leaves(a._replace(hyper=None)))
    # the hyper-parameters: the constructor's, as float64 scalars on the params' device (data, not constants)
    assert {k: float(v) for k, v in a.hyper.items()} == {"lr": 0.1, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8,
                                                          "weight_decay": 0.01}
    assert all(v.dtype == torch.float64 and v.shape == () for v in a.hyper.values())
    # Empty trees are allowed and just count.
    p, st_ = adam(lr=0.1).update({}, adam(lr=0.1).init({}), {})
    assert p == {} and int(st_.count) == 1


# ---------------------------------------------------------------- schedules


def test_schedule_values():
    assert float(schedules.constant(0.3)(torch.tensor(7))) == 0.3
    warm = schedules.linear_warmup(0.4, warmup_steps=8, start=0.1)
    assert [float(warm(t)) for t in (0, 4, 8, 100)] == [0.1, pytest.approx(0.25), 0.4, 0.4]
    assert float(schedules.linear_warmup(0.4, 0)(0)) == 0.4
    cos = schedules.cosine_decay(1.0, decay_steps=20, final=0.2)
    assert float(cos(0)) == 1.0 and float(cos(20)) == 0.2 and float(cos(1000)) == 0.2
    assert float(cos(10)) == pytest.approx((1.0 + 0.2) / 2, abs=1e-12)
    wc = schedules.warmup_cosine(2.0, warmup_steps=10, total_steps=30, final=0.5)
    assert float(wc(0)) == 0.0 and float(wc(5)) == pytest.approx(1.0) and float(wc(10)) == 2.0
    assert float(wc(20)) == pytest.approx(1.25) and float(wc(30)) == 0.5 and float(wc(31)) == 0.5
    assert float(schedules.scale(wc, 0.5)(10)) == 1.0


def test_schedule_tensor_semantics():
    count = torch.tensor(3, dtype=torch.int64)
    for s in [schedules.constant(1.0), schedules.warmup_cosine(1.0, 2, 5), schedules.scale(schedules.cosine_decay(1.0, 4), 2)]:
        out = s(count)
        assert isinstance(out, torch.Tensor) and out.dtype == torch.float64 and out.shape == ()
        assert out.device == count.device


def test_join_boundaries():
    s = schedules.join(
        [schedules.constant(1.0), schedules.linear_warmup(3.0, 4, start=2.0), schedules.constant(0.5)], [5, 9]
    )
    values = [float(s(torch.tensor(t))) for t in range(12)]
    assert values == [1.0] * 5 + [2.0, 2.25, 2.5, 2.75] + [0.5] * 3
    # Each later schedule sees count - boundary.
    seen = []
    probe = schedules.join([schedules.constant(0.0), lambda c: (seen.append(int(c)), torch.zeros((), dtype=torch.float64))[1]], [7])
    probe(torch.tensor(10))
    assert seen == [3]


# ---------------------------------------------------------------- compile


def compiled_and_eager_updates(opt, params, grads, backend: str):
    """``opt.update`` over ``grads`` under ``torch.compile(fullgraph=True)`` and eagerly, from ``params``:
    ``(compiled params, compiled state, eager params, eager state, graphs compiled)``.

    Graphs are Dynamo's unique graphs: its first analysis of a step whose state holds float64 scalars (the
    hyper-parameters) restarts once (its float-scalar pass keeps them tensors, no guard on their values), which
    calls the backend twice for one graph; a recompile would make a second graph."""
    from torch._dynamo.testing import CompileCounterWithBackend
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()

    def step(params, state, g):
        return opt.update(g, state, params)

    counter = CompileCounterWithBackend(backend)
    compiled = torch.compile(step, backend=counter, fullgraph=True)
    p_c, s_c = params, opt.init(params)
    p_e, s_e = params, opt.init(params)
    for g in grads:
        p_c, s_c = compiled(p_c, s_c, g)
        p_e, s_e = step(p_e, s_e, g)
    return p_c, s_c, p_e, s_e, counters["stats"]["unique_graphs"]


def test_compiled_step_matches_eager_and_compiles_once():
    opt = adamw(lr=schedules.warmup_cosine(0.05, warmup_steps=2, total_steps=5, final=0.01), weight_decay=0.1)
    params = make_params(seed=5)
    p_c, s_c, p_e, s_e, graphs = compiled_and_eager_updates(opt, params, make_grads(params, steps=5, seed=6),
                                                            "inductor")
    assert graphs == 1
    assert int(s_c.count) == 5 and s_c.count.dtype == torch.int64
    assert_tree_close(p_c, p_e)
    assert_tree_close(s_c, s_e)


# ---------------------------------------------------------------- validation


@pytest.mark.parametrize(
    "make, exc, match",
    [
        (lambda: sgd(lr="abc"), TypeError, r"lr must be a float >= 0 or a schedule callable\(count\) -> lr; got 'abc' \(str\)"),
        (lambda: adam(lr=-0.1), ValueError, r"lr must be .* got -0\.1 \(float\)"),
        (lambda: adamw(lr=float("nan")), ValueError, r"lr must be .* got nan"),
        (lambda: sgd(lr=True), TypeError, r"lr must be .* got True \(bool\)"),
        (lambda: sgd(lr=torch.tensor(0.1)), TypeError, r"lr must be .*\(Tensor\)"),
        (lambda: adam(lr=0.1, betas=(1.0, 0.999)), ValueError, r"betas\[0\] must be a float in \[0, 1\); got 1\.0"),
        (lambda: adamw(lr=0.1, betas=(0.9, -0.5)), ValueError, r"betas\[1\] .* got -0\.5"),
        (lambda: adam(lr=0.1, betas=0.9), TypeError, r"betas must be a pair .* got 0\.9"),
        (lambda: adam(lr=0.1, eps=-1e-8), ValueError, r"eps must be a float >= 0; got -1e-08"),
        (lambda: adamw(lr=0.1, weight_decay=-0.01), ValueError, r"weight_decay must be a float >= 0; got -0\.01"),
        (lambda: sgd(lr=0.1, weight_decay=-1), ValueError, r"weight_decay .* got -1 \(int\)"),
        (lambda: sgd(lr=0.1, momentum=-0.9), ValueError, r"momentum must be a float >= 0; got -0\.9"),
        (lambda: sgd(lr=0.1, nesterov=True), ValueError, r"nesterov=True requires momentum > 0 .* momentum=0\.0"),
        (lambda: sgd(lr=0.1, momentum=0.9, dampening=0.1, nesterov=True), ValueError, r"dampening=0\.1"),
        (lambda: schedules.join([schedules.constant(1.0), 0.5], [3]), TypeError, r"schedules\[1\] must be .* got 0\.5 \(float\)"),
        (lambda: schedules.join([schedules.constant(1.0)] * 2, [1, 2]), ValueError, r"1 boundaries; got 2"),
        (lambda: schedules.join([schedules.constant(1.0)] * 2, [-1]), ValueError, r"boundaries\[0\] must be an int >= 0; got -1"),
        (lambda: schedules.linear_warmup(1.0, -5), ValueError, r"warmup_steps must be an int >= 0; got -5"),
        (lambda: schedules.linear_warmup(1.0, 2.5), TypeError, r"warmup_steps must be an int .* got 2\.5"),
        (lambda: schedules.cosine_decay(1.0, 0), ValueError, r"decay_steps must be an int >= 1; got 0"),
        (lambda: schedules.warmup_cosine(1.0, 10, 5), ValueError, r"total_steps must be > warmup_steps=10; got 5"),
        (lambda: schedules.constant("x"), TypeError, r"value must be a finite float; got 'x'"),
        (lambda: schedules.scale(3.0, 2.0), TypeError, r"schedule must be .* got 3\.0"),
    ],
)
def test_bad_arguments(make, exc, match):
    with pytest.raises(exc, match=match):
        make()


def test_init_rejects_non_floating_leaf():
    params = {"emb": {"weight": torch.zeros(3, 2), "index": torch.arange(3)}}
    for opt in (sgd(lr=0.1), adam(lr=0.1), adamw(lr=0.1)):
        with pytest.raises(TypeError, match=r"'emb/index' has dtype torch\.int64"):
            opt.init(params)
    with pytest.raises(TypeError, match=r"'b' must be a floating-point torch\.Tensor; got float"):
        sgd(lr=0.1).init({"a": torch.zeros(1), "b": 1.0})
    half = adam(lr=0.1).init({"a": torch.zeros(2, dtype=torch.float16)})  # any floating dtype is fine
    assert half.exp_avg["a"].dtype == torch.float16


# ---------------------------------------------------------------- schedules: linear decay, horizons, check_covers


def test_linear_decay_schedules():
    ld = schedules.linear_decay(1.0, decay_steps=8, final=0.2)
    assert [float(ld(t)) for t in (0, 8, 9)] == [1.0, 0.2, 0.2]
    assert float(ld(4)) == pytest.approx(0.6, abs=1e-15)
    wl = schedules.warmup_linear_decay(2.0, warmup_steps=4, total_steps=12, final=0.4)
    assert [float(wl(t)) for t in (0, 2, 4, 12, 13)] == [0.0, 1.0, 2.0, 0.4, 0.4]
    assert float(wl(8)) == pytest.approx(1.2, abs=1e-15)
    out = wl(torch.tensor(5))
    assert out.dtype == torch.float64 and out.shape == ()


def test_parity_warmup_linear_decay_with_lambda_lr():
    sched = schedules.warmup_linear_decay(0.05, warmup_steps=8, total_steps=40, final=0.0)
    params = make_params(seed=8)
    grads = make_grads(params, steps=40, seed=9)
    expected, torch_lrs = run_torch(torch.optim.AdamW, dict(lr=1.0, weight_decay=0.1), params, grads,
                                    lr_lambda=_lambda(sched))
    actual, _, our_lrs = run_functional(adamw(lr=sched, weight_decay=0.1), params, grads)
    assert our_lrs == torch_lrs
    assert bits_equal(actual, expected)


@settings(max_examples=25, deadline=None)
@given(
    kind=st.sampled_from(["cosine_decay", "linear_decay", "warmup_cosine", "warmup_linear_decay", "joined", "scaled"]),
    warmup=st.integers(0, 20),
    length=st.integers(1, 50),
    peak=st.floats(1e-4, 1.0),
    final=st.floats(0.0, 1e-5),
)
def test_property_horizon_is_where_the_schedule_ends(kind, warmup, length, peak, final):
    """``schedule.total_steps`` = H: the lr is ``final`` from update H on and not before (peak > final)."""
    s = {
        "cosine_decay": lambda: schedules.cosine_decay(peak, length, final),
        "linear_decay": lambda: schedules.linear_decay(peak, length, final),
        "warmup_cosine": lambda: schedules.warmup_cosine(peak, warmup, warmup + length, final),
        "warmup_linear_decay": lambda: schedules.warmup_linear_decay(peak, warmup, warmup + length, final),
        "joined": lambda: schedules.join([schedules.constant(peak), schedules.linear_decay(peak, length, final)],
                                         [warmup]),
        "scaled": lambda: schedules.scale(schedules.warmup_cosine(peak, warmup, warmup + length, final), 2.0),
    }[kind]()
    horizon = schedules.horizon(s)
    assert horizon == s.total_steps == (length if kind in ("cosine_decay", "linear_decay") else warmup + length)
    end = float(s(horizon))
    assert end == pytest.approx(final * (2.0 if kind == "scaled" else 1.0), abs=1e-15)
    assert [float(s(horizon + k)) for k in (1, 10, 1000)] == [end] * 3
    assert float(s(horizon - 1)) > end
    schedules.check_covers(s, horizon)
    with pytest.raises(ValueError, match=rf"built for {horizon} updates .* the run takes {horizon + 1}: "
                                         rf"updates {horizon}\.\.{horizon} would all use its final lr"):
        schedules.check_covers(s, horizon + 1)


def test_check_covers_rules():
    forever = [0.1, schedules.constant(0.1), schedules.linear_warmup(0.1, 10), lambda c: 0.1,
               schedules.join([schedules.cosine_decay(1.0, 5), schedules.constant(0.1)], [5]), sgd(0.1)]
    for s in forever:
        assert schedules.horizon(s) is None
        schedules.check_covers(s, 10**9)
    opt = adamw(lr=schedules.warmup_cosine(1e-3, warmup_steps=10, total_steps=100, final=1e-5))
    assert schedules.horizon(opt) == 100
    schedules.check_covers(opt, 100)
    with pytest.raises(ValueError, match=r"built for 100 updates \(total_steps=100\) but the run takes 250: "
                                         r"updates 100\.\.249 would all use its final lr 1e-05; build it with "
                                         r"total_steps >= 250"):
        schedules.check_covers(opt, 250)

    def mine(count):
        return schedules.constant(0.5)(count)

    mine.total_steps = 7  # a schedule of your own opts in with the attribute
    with pytest.raises(ValueError, match=r"built for 7 updates"):
        schedules.check_covers(mine, 8)
    with pytest.raises(TypeError, match=r"check_covers: total_steps must be an int >= 0; got 1\.5 \(float\)"):
        schedules.check_covers(opt, 1.5)
    mine.total_steps = "x"
    with pytest.raises(TypeError, match=r"schedule\.total_steps must be an int >= 0; got 'x'"):
        schedules.horizon(mine)


@pytest.mark.parametrize("make, exc, match", [
    (lambda: schedules.warmup_linear_decay(1.0, 10, 10), ValueError, r"total_steps must be > warmup_steps=10; got 10"),
    (lambda: schedules.warmup_linear_decay(1.0, -1, 10), ValueError, r"warmup_steps must be an int >= 0; got -1"),
    (lambda: schedules.linear_decay(1.0, 0), ValueError, r"linear_decay: decay_steps must be an int >= 1; got 0"),
    (lambda: schedules.linear_decay("a", 3), TypeError, r"linear_decay: peak must be a finite float; got 'a'"),
])
def test_bad_linear_decay_arguments(make, exc, match):
    with pytest.raises(exc, match=match):
        make()
