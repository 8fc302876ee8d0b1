"""Every transform keeps its law under sharded data parallelism, or the sharded step refuses it by name.

Under ``data_parallel(shard="optimizer" | "params")`` the hooks from the ``reduce`` stage on see this rank's
flat shard of the gradients and params (``{"float32": 1-D tensor}``: no leaf names, no shapes). A transform
says what it needs of them (``Transform.needs``): ``"elementwise"`` and ``"global"`` run on the shard,
``"leaves"`` gets the whole named leaves in its ``check`` / ``transform`` hooks (gathered, run, cut back) and
is refused in the others, and a transform that declares nothing is refused by name when the sharded step is
built, before step 1: never a silent difference from one process.

The four user transforms of issue 31 are written here as a user writes them from docs/transforms.md:
gradient centralisation and a per-layer learning-rate scale (by leaf name), which need whole leaves; the
docs' gradient noise, which draws from the step's generator and declares nothing; and the docs' Lookahead
(elementwise, its slow weights declared in ``params_fields``). Before ``needs`` existed the first two
drifted from one process silently (max difference ~1e-2 here) and the noise ran on shards.
"""
from __future__ import annotations

from typing import Any, NamedTuple

import pytest
import torch

import functrain as ft
from functrain import tree as T

MODES = ("optimizer", "params", "blocks")  # blocks: shard="params", blocks=model (the second Linear a block)
STEPS = 3
TOL = 1e-6  # fp32, eager: the sums of 2 ranks' halves against the whole batch
SHARD = {"optimizer": "optimizer", "params": "params", "blocks": "params"}


# -- the user transforms, as docs/transforms.md has users write them ------------------------------------------
class GradCentral(ft.Transform):
    """Gradient centralisation (Yong et al. 2020): each weight's gradient minus its mean over all but its first
    dimension (leaves with ndim > 1). Declares nothing: what the researcher of issue 31 wrote."""

    name = "grad_central"
    order = 50

    def transform(self, ctx):
        ctx.grads = T.tree_map(lambda g: g - g.mean(dim=tuple(range(1, g.ndim)), keepdim=True) if g.ndim > 1
                               else g, ctx.grads)


class GradCentralLeaves(GradCentral):
    """The same, declaring that it needs whole leaves with their shapes."""

    needs = "leaves"


class LayerScale(ft.Transform):
    """A per-layer learning-rate scale: each gradient leaf times the factor chosen by its name (1 otherwise)."""

    name = "layer_scale"
    order = 60
    needs = "leaves"

    def __init__(self, factors: dict[str, float]):
        self.factors = factors

    def transform(self, ctx):
        ctx.grads = {k: g * self.factors.get(k, 1.0) for k, g in ctx.grads.items()}


class LayerScaleUndeclared(LayerScale):
    needs = None  # (as before Transform.needs existed)


class UpdateScale(ft.Transform):
    """The per-layer scale applied to the optimizer's update instead (stage ``update``): needs whole leaves there."""

    name = "update_scale"
    order = 60
    needs = "leaves"

    def __init__(self, factors: dict[str, float]):
        self.factors = factors

    def wrap_update(self, update_fn, ctx):
        def scaled(grads, opt_state, params):
            new, opt_state = update_fn(grads, opt_state, params)
            return {k: params[k] + self.factors.get(k, 1.0) * (new[k] - params[k]) for k in new}, opt_state

        return scaled


class GradNoise(ft.Transform):
    """The docs' first example: Gaussian gradient noise from the step's generator, a count in its slot."""

    name = "grad_noise"
    order = 50

    def __init__(self, std):
        self.std = std

    def init(self, params, buffers):
        return {"count": torch.zeros((), dtype=torch.int64)}

    def transform(self, ctx):
        ctx.grads = T.tree_map(lambda g: g + self.std * torch.randn_like(g), ctx.grads)
        ctx.set_slot(self, {"count": ctx.slot(self)["count"] + 1})


@ft.register_checkpoint_type("tests.laws.SlowWeightsState")
class SlowWeightsState(NamedTuple):
    slow: Any
    count: torch.Tensor


class Lookahead(ft.Transform):
    """The docs' Lookahead: every k applied updates, slow += alpha * (params - slow), then params = slow."""

    name = "lookahead"
    order = 50
    params_fields = ("slow",)
    needs = "elementwise"

    def __init__(self, k=2, alpha=0.5):
        self.k, self.alpha = k, alpha

    def init(self, params, buffers):
        return SlowWeightsState(T.tree_map(lambda p: p.detach().clone(), params),
                                torch.zeros((), dtype=torch.int64, device=T.tree_leaves(params)[0].device))

    def after(self, ctx):
        old = ctx.slot(self)
        applied = torch.ones((), dtype=torch.bool) if ctx.apply is None else ctx.apply
        count = old.count + applied.to(torch.int64)
        sync = applied & (count % self.k == 0)
        moved = T.tree_map(lambda s, p: s + self.alpha * (p - s), old.slow, ctx.params)
        ctx.params = T.tree_select(sync, moved, ctx.params)
        ctx.set_slot(self, SlowWeightsState(T.tree_select(sync, moved, old.slow), count))


FACTORS = {"0.weight": 0.5, "2.weight": 3.0, "2.bias": 0.0}

# case -> (the transforms, outermost last; what a sharded step must do: "equal" or "refused")
CASES: dict[str, tuple[Any, str]] = {
    "grad_central": (lambda: [GradCentral()], "refused"),
    "grad_central_leaves": (lambda: [GradCentralLeaves()], "equal"),
    "layer_scale": (lambda: [LayerScale(FACTORS)], "equal"),
    "layer_scale_undeclared": (lambda: [LayerScaleUndeclared(FACTORS)], "refused"),
    "update_scale": (lambda: [UpdateScale(FACTORS)], "refused"),
    "grad_noise": (lambda: [GradNoise(1e-2)], "refused"),
    "lookahead": (lambda: [Lookahead()], "equal"),
    "leaves_with_builtins": (lambda: [ft.clip(0.05), GradCentralLeaves(), LayerScale(FACTORS), ft.ema(0.5, warmup=False)],
                             "equal"),
    # the built-ins
    "clip": (lambda: [ft.clip(0.05)], "equal"),
    "clip_value": (lambda: [ft.clip_value(0.01)], "equal"),
    "ema": (lambda: [ft.ema(0.5, warmup=False)], "equal"),
    "accumulate": (lambda: [ft.accumulate(2)], "equal"),
    "streaming": (lambda: [ft.accumulate(2, streaming=True)], "equal"),
    "skip_nonfinite": (lambda: [ft.skip_nonfinite()], "equal"),
    "fp16": (lambda: [ft.mixed_precision("fp16", init_scale=256.0)], "equal"),
    "random_flip": (lambda: [ft.random_flip(p=1.0, key=0)], "equal"),  # p=1: every row flipped, no draw decides
}


def problem(rank: int = 0, blocks: bool = False):
    """A 67-parameter MLP (two weight matrices; the shard boundary cuts 0.bias), SGD with momentum, 3 batches of 8
    rows; rank 1 starts from other weights (the sharded init broadcasts rank 0's). ``blocks``: its second Linear
    marked with ft.remat, and the model returned last."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    if blocks:
        ft.remat(model[2])
    apply_fn, params, buffers = ft.functionalize(model)
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(8, 4, generator=g), torch.randn(8, 3, generator=g)) for _ in range(STEPS)]

    def loss_fn(params, buffers, batch):
        return torch.nn.functional.mse_loss(apply_fn(params, buffers, batch[0]), batch[1])

    if rank:
        params = {k: v + 1.0 for k, v in params.items()}
    return (loss_fn, params, buffers, batches) + ((model,) if blocks else ())


def make_step(loss_fn, case: str, reference: bool = False, world: int = 2):
    step = ft.train_step(loss_fn, ft.optim.sgd(0.1, momentum=0.9))
    transforms = CASES[case][0]()
    if reference and case == "fp16":  # the same micro-batches as the ranks' halves (fp16 rounding groups so)
        transforms = [ft.accumulate(world)] + transforms
    if reference and case == "accumulate":
        transforms = [ft.accumulate(2 * world)]
    for t in transforms:
        step = t(step)
    return step


def rows(batch, rank: int, world: int):
    n = batch[0].shape[0] // world
    return tuple(t[rank * n:(rank + 1) * n] for t in batch)


def calls(case: str, batches):
    """The batches a run feeds: a streaming accumulation takes each batch as 2 calls."""
    return [b for b in batches for _ in range(2)] if case == "streaming" else batches


def max_diff(a, b) -> float:
    return max((float((x.double() - y.double()).abs().max()) for x, y in zip(T.tree_leaves(a), T.tree_leaves(b))
                if x.is_floating_point()), default=0.0)


def run_case(case: str, mode: str, rank: int, world: int, compiled: bool = False) -> dict:
    """One case under one sharding mode on this rank: refused (when, and the message) or trained and compared
    with one process on the whole batches."""
    loss_fn, params0, buffers, batches = problem(0)
    one = make_step(loss_fn, case, reference=True, world=world)
    reference = one.init(params0, buffers)
    for b in calls(case, batches):
        reference, _ = one(reference, b)
    loss_fn, params, buffers, *_, model = problem(rank, blocks=True)
    where = "wrapping"
    try:
        dp = ft.data_parallel(shard="params", blocks=model) if mode == "blocks" else ft.data_parallel(shard=mode)
        step = dp(make_step(loss_fn, case))
        where = "init"
        state = step.init(params, buffers)
        run = ft.compile(step, backend="aot_eager") if compiled else step
        for i, b in enumerate(calls(case, batches)):
            where = f"step {i + 1}"
            state, _ = run(state, rows(b, rank, world))
    except (ValueError, TypeError) as e:
        return {"refused": where, "message": str(e)}
    full = ft.gather_state(state)
    flat = torch.cat([p.reshape(-1) for p in T.tree_leaves(full.params)])
    if world > 1:
        import torch.distributed as dist

        others = [torch.empty_like(flat) for _ in range(world)]
        dist.all_gather(others, flat)
    else:
        others = [flat]
    return {"err": max_diff(full, reference), "same_structure": T.tree_structure(full) == T.tree_structure(reference),
            "ranks_identical": all(torch.equal(others[0], o) for o in others),
            "moved": max_diff(full.params, params0)}


def cases_of(mode: str) -> list[str]:
    # (not here: a streaming accumulation with blocks=, whose whole-params-shaped running sum meets the shard
    # gradient that per-block gathering makes, and fails at step 1 on a key mismatch: a limitation of its own)
    return [c for c in CASES if not (mode == "blocks" and c == "streaming")]


def _worker(modes, compiled_cases) -> dict:
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    for mode in modes:
        for case in cases_of(mode):
            out[(mode, case, False)] = run_case(case, mode, rank, world)
        for case in compiled_cases:
            out[(mode, case, True)] = run_case(case, mode, rank, world, compiled=True)
    return out


def problems(what: str, case: str, compiled: bool, mode: str, r: dict) -> list[str]:
    """What is wrong with one case's report (nothing: it kept its law, or was refused by name when built)."""
    expected = CASES[case][1]
    if "refused" in r:
        if r["refused"] != "wrapping":  # never late: a refusal comes when the sharded step is built
            return [f"{what}: refused at {r['refused']}, not when built: {r['message']}"]
        if expected != "refused":
            return [f"{what}: refused, but it must keep its law: {r['message']}"]
        t = CASES[case][0]()[-1]
        return [f"{what}: the refusal does not name {word!r}: {r['message']}"
                for word in (repr(t), type(t).__qualname__, f"shard={SHARD[mode]!r}", "needs")
                if word not in r["message"]]
    if expected != "equal":
        return [f"{what}: ran (max difference {r['err']:.2e} from one process) instead of being refused before "
                f"step 1"]
    tol = 1e-5 if compiled else TOL
    return [message for ok, message in (
        (r["same_structure"], f"{what}: gather_state's structure is not the one-process state's"),
        (r["ranks_identical"], f"{what}: the gathered params differ between ranks"),
        (r["moved"] > 1e-3, f"{what}: the params did not train ({r['moved']:.2e})"),
        (r["err"] <= tol, f"{what}: differs from one process on the whole batch by {r['err']:.2e}"),
    ) if not ok]


def check(report: dict, what_rank: str) -> None:
    bad = [p for (mode, case, compiled), r in report.items()
           for p in problems(f"{what_rank}shard={mode!r} {case}{' compiled' if compiled else ''}", case, compiled,
                             mode, r)]
    assert not bad, f"{len(bad)} of {len(report)} cases broke the law silently or were refused wrongly:\n" + \
        "\n".join(bad)


# -- one process: sharded over 1 rank (the trainer's layout on one process), no launch ---------------------------
@pytest.mark.parametrize("mode", MODES)
def test_sharded_over_one_rank_keeps_each_law_or_refuses(mode):
    """The same cases on one process sharded over 1 rank: the hooks already see one flat buffer per dtype
    there, so centralisation and the per-layer scale were silently wrong on one process too."""
    check({(mode, case, False): run_case(case, mode, 0, 1) for case in cases_of(mode)}, "1 rank, ")


def test_two_processes_keep_each_law_or_refuse():
    """2 ranks (gloo) under shard="optimizer", "params" and "params" with blocks= against one process on the whole batches: each case
    equal to float rounding, or refused by name before step 1; centralisation compiled too (aot_eager)."""
    reports = ft.launch(_worker, nprocs=2, args=(list(MODES), ["grad_central_leaves"]), timeout=420)
    for rank, report in enumerate(reports):
        check(report, f"rank {rank}, ")


# -- what the refusal says, and what is never refused ----------------------------------------------------------
def _loss(params, buffers, x):
    return (params["w"] * x).sum()


HOOKS = ("wrap_grad", "reduce", "check", "transform", "wrap_update", "commit", "after")


def _undeclared(hook: str) -> ft.Transform:
    def passthrough(self, *args):
        return args[0] if hook.startswith("wrap_") else None

    return type(f"Undeclared_{hook}", (ft.Transform,), {"name": f"my_{hook}", hook: passthrough})()


@pytest.mark.parametrize("mode", ("optimizer", "params"))
@pytest.mark.parametrize("hook", HOOKS)
def test_undeclared_hook_refused_by_name_when_built(mode, hook):
    """A transform that declares nothing and implements a hook that sees the sharded gradients or params is
    refused when the sharded step is built, whichever wraps first; the message names the transform, the hook,
    the sharding mode and the declarations to choose from."""
    if hook == "wrap_grad" and mode == "optimizer":
        pytest.skip("shard='optimizer' hands wrap_grad the whole params and gradients: nothing to refuse")
    base = ft.train_step(_loss, ft.optim.sgd(0.1))
    t = _undeclared(hook)
    for build in (lambda: ft.data_parallel(shard=mode)(t(base)), lambda: t(ft.data_parallel(shard=mode)(base))):
        with pytest.raises(ValueError) as err:
            build()
        message = str(err.value)
        for word in (repr(t), type(t).__qualname__, hook, f"shard={mode!r}", 'needs = "elementwise"',
                     '"global"', '"leaves"'):
            assert word in message, f"{word!r} not in: {message}"


def test_undeclared_wrap_grad_runs_under_optimizer_sharding():
    """shard="optimizer": wrap_grad sees the whole params and gradients, so an undeclared one is not refused."""
    t = _undeclared("wrap_grad")
    step = ft.data_parallel(shard="optimizer")(t(ft.train_step(_loss, ft.optim.sgd(0.1))))
    state, _ = step(step.init({"w": torch.ones(3)}), torch.ones(3))
    assert torch.allclose(ft.gather_state(state).params["w"], torch.full((3,), 0.9))


@pytest.mark.parametrize("mode", ("optimizer", "params"))
@pytest.mark.parametrize("hook", ["wrap_update", "commit", "after", "reduce"])
def test_leaves_refused_where_not_gathered(mode, hook):
    """needs="leaves" is served in check and transform only; elsewhere refused by name, saying where it works."""
    t = _undeclared(hook)
    type(t).needs = "leaves"
    with pytest.raises(ValueError) as err:
        ft.data_parallel(shard=mode)(t(ft.train_step(_loss, ft.optim.sgd(0.1))))
    message = str(err.value)
    for word in (repr(t), hook, f"shard={mode!r}", '"leaves"', "transform"):
        assert word in message, f"{word!r} not in: {message}"


def test_leaves_with_params_fields_refused():
    """A "leaves" hook would see whole leaves next to its slot's 1/N shard: refused by name."""
    class Both(GradCentralLeaves):
        name = "both"
        params_fields = ("m",)

        def init(self, params, buffers):
            return {"m": T.tree_map(torch.zeros_like, params)}

    with pytest.raises(ValueError, match="params_fields") as err:
        ft.data_parallel(shard="optimizer")(Both()(ft.train_step(_loss, ft.optim.sgd(0.1))))
    assert "Both('both')" in str(err.value)


def test_needs_must_be_one_of_the_kinds():
    with pytest.raises(ValueError) as err:
        type("Bad", (ft.Transform,), {"name": "bad", "needs": "per_leaf"})
    message = str(err.value)
    assert "'per_leaf'" in message and "Bad" in message
    for kind in ("elementwise", "leaves", "global"):
        assert repr(kind) in message, message


def test_builtins_declare_what_they_need():
    from functrain.distributed.data_parallel import DataParallel
    from functrain.distributed.sharding import ShardedDataParallel

    builtins = [ft.clip(1.0), ft.clip_value(1.0), ft.ema(0.9, warmup=False), ft.accumulate(2), ft.accumulate(2, streaming=True),
                ft.mixed_precision("fp16"), ft.skip_nonfinite(), ft.random_flip(), ft.data_parallel(),
                ft.data_parallel(shard="optimizer")]
    needs = {type(t).__name__: t.needs for t in builtins}
    assert needs == {"Clip": "global", "ClipValue": "elementwise", "EMA": "elementwise", "Accumulate": "elementwise",
                     "StreamingAccumulate": "elementwise", "MixedPrecision": "global", "SkipNonfinite": "global",
                     "RandomFlip": "elementwise", "DataParallel": "global", "ShardedDataParallel": "global"}
    assert DataParallel.needs and ShardedDataParallel.needs


def test_replicated_data_parallel_takes_undeclared_transforms():
    """data_parallel() (no sharding) hands whole leaves: an undeclared transform runs there unchanged."""
    base = ft.train_step(_loss, ft.optim.sgd(0.1))
    plain = GradCentral()(base)
    step = ft.data_parallel()(GradCentral()(base))
    params = {"w": torch.arange(6.0).reshape(2, 3)}
    x = torch.arange(6.0).reshape(2, 3) ** 2
    a, _ = step(step.init(params), x)
    b, _ = plain(plain.init(params), x)
    assert T.tree_equal(a.params, b.params)
    assert not torch.equal(a.params["w"], params["w"] - 0.1 * x)  # (centralised: not the plain SGD step)
