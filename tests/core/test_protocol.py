"""The closed transform protocol: one stage table, declared hooks, accessors, the shared finiteness rule, the RNG."""
from __future__ import annotations

import pytest
import torch

import functrain as ft
import functrain.testing as ftt
from functrain.core import step as S
from functrain.core.rng import with_rng
from conftest import fixed_problem, with_value


def base(optimizer=None):
    return ft.train_step(ftt.mlp_loss, optimizer or ft.optim.sgd(0.1))


def test_one_stage_table():
    assert ft.STAGES == ("loss", "grad", "reduce", "normalise", "check", "transform", "update", "commit", "after")
    assert ft.STAGES == tuple(s.name for s in S.PIPELINE)
    assert S.HOOKS == ("wrap_loss", "wrap_grad", "reduce", "check", "transform", "wrap_update", "commit", "after")
    for hook in S.HOOKS + ("init", "post_init", "rng_offset"):
        assert callable(getattr(ft.Transform, hook)), f"{hook} is not declared on Transform"
    step = ft.ema(0.9, warmup=False)(ft.clip(1.0)(base()))
    assert len(step._stages) == len(S.PIPELINE)  # apply runs exactly the table's stages


@pytest.mark.parametrize("method, hook", [("update", "wrap_update"), ("loss", "wrap_loss"), ("grad", "wrap_grad"),
                                          ("rng_rank", "rng_offset"), ("normalise", None)])
def test_undeclared_hooks_are_refused(method, hook):
    with pytest.raises(TypeError, match=f"no hook '{method}'" + (f".*'{hook}'" if hook else "")):
        type("Bad", (ft.Transform,), {"name": "bad", method: lambda self, *a: None})


class HalveUpdate(ft.Transform):
    """wrap_update: the optimizer sees half the gradient, and the grads it got are recorded."""

    name = "halve_update"

    def __init__(self, order=0, log=None):
        self.order, self.log = order, log

    def wrap_update(self, update_fn, ctx):
        def halved(grads, opt_state, params):
            if self.log is not None:
                self.log.append(self.order)
            ctx.metrics["update_grad_norm"] = ft.tree.global_norm(grads)
            return update_fn(ft.tree.tree_scale(grads, 0.5), opt_state, params)

        return halved


def test_wrap_update_runs_at_the_update_stage():
    params, batches = fixed_problem()
    step = HalveUpdate()(ft.clip(0.1)(base()))
    ref = ft.clip(0.1)(base(ft.optim.sgd(0.05)))
    got, metrics = step(step.init(params), batches[0])
    want, ref_metrics = ref(ref.init(params), batches[0])
    ftt.assert_same_state(got.params, want.params, rtol=1e-6, atol=0)  # sgd: lr * (g / 2) == (lr / 2) * g
    # it sees the gradients after the transform stage (clipped to norm 0.1)
    assert float(ref_metrics["grad_norm"]) > 0.1
    assert abs(float(metrics["update_grad_norm"]) - 0.1) < 1e-5
    # ... and the commit stage still drops a non-finite update it made
    skip = ft.skip_nonfinite()(step)
    state = skip.init(params)
    new, m = skip(state, with_value(batches[0], float("inf")))
    assert bool(m["skipped"]) and ft.tree.tree_equal((new.params, new.opt_state), (state.params, state.opt_state))


def test_wrap_update_composes_lowest_order_outermost():
    params, batches = fixed_problem()
    log = []
    inner = type("Inner", (HalveUpdate,), {"name": "inner"})(order=5, log=log)
    step = inner(HalveUpdate(order=1, log=log)(base()))
    quarter = base(ft.optim.sgd(0.025))
    got, _ = step(step.init(params), batches[0])
    want, _ = quarter(quarter.init(params), batches[0])
    assert log == [1, 5]
    ftt.assert_same_state(got.params, want.params, rtol=1e-6, atol=0)


class Offset(ft.Transform):
    def __init__(self, name, offset):
        self.name, self.offset = name, offset

    def rng_offset(self):
        return self.offset


def noisy_loss(params, buffers, batch):
    loss = ftt.mlp_loss(params, buffers, batch)
    return loss, {"noise": torch.rand(())}


def test_rng_offset_is_declared_and_summed():
    params, batches = fixed_problem()
    plain = ft.train_step(noisy_loss, ft.optim.sgd(0.1))
    state = plain.init(params, seed=11)
    offset = Offset("a", 2)(Offset("b", 3)(plain))
    assert plain.rng_offset() == 0 and offset.rng_offset() == 5
    _, m = offset(state, batches[0])
    _, m0 = plain(state, batches[0])
    _, m5 = with_rng(plain.apply, state, batches[0], 5)
    assert torch.equal(m["noise"], m5["noise"]) and not torch.equal(m["noise"], m0["noise"])


def _splitmix64(x):
    mask = 2**64 - 1
    x = (x + 0x9E3779B97F4A7C15) & mask
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & mask
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & mask
    return x ^ (x >> 31)


@pytest.mark.parametrize("seed, counter, rank", [(0, 0, 0), (7, 3, 1), (2**63 - 1, 12345, 0)])
def test_rng_draws_are_those_of_the_documented_key_schedule(seed, counter, rank):
    """Moving the RNG to functrain.core.rng kept every draw: seed_step = splitmix(splitmix(seed) ^ counter) >> 2,
    plus the offset, computed here independently."""
    params, batches = fixed_problem()
    step = ft.train_step(noisy_loss, ft.optim.sgd(0.1))
    state = step.init(params, seed=seed).replace(rng={"key": torch.tensor([seed, counter], dtype=torch.int64)})
    new, metrics = with_rng(step.apply, state, batches[0], rank)
    expected = torch.rand((), generator=torch.Generator().manual_seed((_splitmix64(_splitmix64(seed) ^ counter) >> 2)
                                                                      + rank))
    assert torch.equal(metrics["noise"], expected)
    assert new.rng["key"].tolist() == [seed, counter + 1]
    with pytest.raises(TypeError, match=r"seed must be an int in \[0, 2\*\*63\)"):
        step.init(params, seed=2**63)


def test_accessors_are_declared_by_transforms():
    params, _ = fixed_problem()

    class Counter(ft.Transform):
        name = "counter_slot"
        accessors = {"counter_value": lambda slot: slot["n"]}

        def init(self, params, buffers):
            return {"n": torch.zeros((), dtype=torch.int64)}

        def after(self, ctx):
            ctx.set_slot(self, {"n": ctx.slot(self)["n"] + 1})

    step = Counter()(base())
    state = step.init(params)
    assert int(step(state, fixed_problem()[1][0])[0].counter_value) == 1
    assert base().init(params).counter_value is None  # no slot: None
    assert "counter_value" in dir(state) and "ema" in dir(state) and "loss_scale" in dir(state)
    with pytest.raises(AttributeError, match="no attribute 'not_an_accessor'"):
        state.not_an_accessor
    with pytest.raises(ValueError, match="already declared for slot 'counter_slot'"):
        type("Other", (ft.Transform,), {"name": "other", "accessors": {"counter_value": lambda s: s}})
    with pytest.raises(ValueError, match="shadow"):
        type("Shadow", (ft.Transform,), {"name": "shadow", "accessors": {"params": lambda s: s}})
    # the built-in conveniences resolve through their transforms
    s = ft.ema(0.9, warmup=False)(ft.mixed_precision("fp16")(base())).init(params)
    assert s.ema is s.slots["ema"].params and s.loss_scale is s.slots["mixed_precision"]


class SkipIfBad(ft.Transform):
    """A user transform built on the shared rule: skip unless finite, count the skips."""

    name = "skip_if_bad"
    order = 10

    def init(self, params, buffers):
        return {"n": torch.zeros((), dtype=torch.int64)}

    def check(self, ctx):
        finite = ctx.skip_unless_finite()
        ctx.set_slot(self, {"n": ctx.slot(self)["n"] + (~finite).to(torch.int64)})


def test_skip_unless_finite_is_one_rule():
    """A user transform using ctx.skip_unless_finite decides exactly as skip_nonfinite (bitwise)."""
    params, batches = fixed_problem()
    mine, theirs = SkipIfBad()(ft.ema(0.9, warmup=False)(base())), ft.skip_nonfinite()(ft.ema(0.9, warmup=False)(base()))
    a, b = mine.init(params), theirs.init(params)
    for i, batch in enumerate(batches[:4]):
        batch = with_value(batch, float("nan")) if i % 2 else batch
        a, ma = mine(a, batch)
        b, mb = theirs(b, batch)
        assert bool(ma["skipped"]) == bool(mb["skipped"]) == bool(i % 2)
        ftt.assert_same_state((a.params, a.opt_state, a.ema), (b.params, b.opt_state, b.ema))
    assert int(a.slots["skip_if_bad"]["n"]) == int(b.slots["skip_nonfinite"]["skipped"]) == 2


class Votes(ft.Transform):
    """agree(): a process-local stand-in for a group's MIN (what data_parallel does over its ranks)."""

    def __init__(self, name, floor, log):
        self.name, self.floor, self.log = name, floor, log

    def agree(self, value):
        self.log.append((self.name, value))
        return min(value, self.floor)


def test_agree_is_declared_and_folds_over_the_transforms():
    assert callable(ft.Transform.agree) and ft.Transform().agree(3) == 3  # one process alone: the value itself
    plain = ft.train_step(ftt.mlp_loss, ft.optim.sgd(0.1))
    assert plain.agree(1) == 1 and plain.agree(-1) == -1
    log = []
    step = Votes("b", 0, log)(Votes("a", 5, log)(plain))
    assert step.agree(1) == 0 and log == [("a", 1), ("b", 1)]  # every transform asked, (order, name) order
    assert ft.data_parallel().agree(1) == 1  # one process: no collective
