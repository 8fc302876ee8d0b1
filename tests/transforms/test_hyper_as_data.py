"""Hyper-parameters as data (issue 40): every value a user changes between runs of one model is an input of the
compiled graph, not a constant of it (functrain/core/hyper.py).

For each value (the lr schedule's peak, warm-up, horizon and final lr; Adam's betas, eps and weight decay; SGD's lr,
momentum, dampening and weight decay; Lion's betas; schedule-free AdamW's warm-up, ``r``, betas and decay; clip's max norm; clip_value's bound; the EMA's decay, start and
warm-up; the fp16 loss scale's growth and backoff): a compiled step that ran with the constructor's values runs a
state whose value was changed with ``ft.set_hyper`` without compiling anything (``cstep.compiles`` stays 1), and
its result equals a fresh eager run of a step built with that value (to the compiled-vs-eager rounding; eagerly
the optimizers do torch.optim's float arithmetic) and, bit for bit, a fresh compile (``aot_eager``) of that step.
Each change is checked to matter: the run with the old value differs. The graphs are captured with ``aot_eager``
(a trace each, seconds); one compiled step per optimizer is shared by the module.
"""
from __future__ import annotations

import pytest
import torch

import functrain as ft
import functrain.testing as ftt
from functrain import tree as T
from functrain.optim import schedules

STEPS = 8


def problem():
    gen = torch.Generator().manual_seed(0)
    params = {"w0": torch.randn(6, 8, generator=gen) / 6**0.5, "b0": torch.randn(8, generator=gen) * 0.1,
              "w1": torch.randn(8, 3, generator=gen) / 8**0.5, "b1": torch.zeros(3)}
    batches = [(torch.randn(8, 6, generator=gen) * 3, torch.randn(8, 3, generator=gen)) for _ in range(STEPS)]
    return params, batches


BASE = {"peak": 2e-2, "warmup_steps": 3, "total_steps": 12, "final": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8,
        "weight_decay": 1e-3, "momentum": 0.9, "dampening": 0.0, "max_norm": 0.5, "clip_value": None,
        "ema_decay": 0.8, "ema_start": 2, "ema_power": 2 / 3, "fp16": False, "growth_interval": 3,
        "backoff_factor": 0.5, "sf_warmup": 0, "sf_r": 0.0}


def build(opt: str, **over):
    v = {**BASE, **over}
    lr = schedules.warmup_cosine(v["peak"], v["warmup_steps"], v["total_steps"], final=v["final"])
    optimizer = {
        "adamw": lambda: ft.optim.adamw(lr, betas=v["betas"], eps=v["eps"], weight_decay=v["weight_decay"]),
        "adam": lambda: ft.optim.adam(lr, betas=v["betas"], eps=v["eps"], weight_decay=v["weight_decay"]),
        "sgd": lambda: ft.optim.sgd(lr, momentum=v["momentum"], dampening=v["dampening"],
                                    weight_decay=v["weight_decay"]),
        "lion": lambda: ft.optim.lion(lr, betas=v["betas"], weight_decay=v["weight_decay"]),
        "schedulefree": lambda: ft.optim.adamw_schedulefree(lr, betas=v["betas"], eps=v["eps"],
                                                            weight_decay=v["weight_decay"],
                                                            warmup_steps=v["sf_warmup"], r=v["sf_r"]),
    }[opt]()
    step = ft.clip(v["max_norm"])(ft.train_step(ftt.mlp_loss, optimizer))
    if v["clip_value"] is not None:
        step = ft.clip_value(v["clip_value"])(step)
    if v["fp16"]:
        step = ft.mixed_precision("fp16", init_scale=2.0**4, growth_interval=v["growth_interval"],
                                  backoff_factor=v["backoff_factor"])(step)
    return ft.ema(v["ema_decay"], start_step=v["ema_start"], power=v["ema_power"])(step)


def run(step, state, batches):
    for b in batches:
        state, _ = step(state, b)
    return state


# (optimizer, what the fresh step is built with, what ft.set_hyper gets)
CHANGES = {
    "adamw-peak": ("adamw", {"peak": 6e-2}, {"lr": {"peak": 6e-2}}),
    "adamw-warmup": ("adamw", {"warmup_steps": 0}, {"lr": {"warmup_steps": 0}}),
    "adamw-horizon": ("adamw", {"total_steps": 4000}, {"lr": schedules.warmup_cosine(2e-2, 3, 4000, final=1e-3)}),
    "adamw-final": ("adamw", {"total_steps": 6, "final": 1e-2}, {"lr": {"total_steps": 6, "final": 1e-2}}),
    "adamw-betas": ("adamw", {"betas": (0.5, 0.9)}, {"betas": (0.5, 0.9)}),
    "adamw-eps": ("adamw", {"eps": 1e-1}, {"eps": 1e-1}),
    "adamw-weight_decay": ("adamw", {"weight_decay": 0.5}, {"weight_decay": 0.5}),
    "sgd-clip": ("sgd", {"max_norm": 0.05}, {"clip": {"max_norm": 0.05}}),
    "adamw-ema_decay": ("adamw", {"ema_decay": 0.3}, {"ema": {"decay": 0.3}}),
    "adamw-ema_warmup": ("adamw", {"ema_start": 0, "ema_power": 1.0}, {"ema": {"start_step": 0, "power": 1.0}}),
    "adam-weight_decay": ("adam", {"weight_decay": 0.5}, {"weight_decay": 0.5}),
    "sgd-lr": ("sgd", {"peak": 0.2}, {"lr": {"peak": 0.2}}),
    "sgd-momentum": ("sgd", {"momentum": 0.5, "dampening": 0.3}, {"momentum": 0.5, "dampening": 0.3}),
    "sgd-weight_decay": ("sgd", {"weight_decay": 0.5}, {"weight_decay": 0.5}),
    "lion-betas": ("lion", {"betas": (0.5, 0.7)}, {"betas": (0.5, 0.7)}),
    "lion-weight_decay": ("lion", {"weight_decay": 5.0}, {"weight_decay": 5.0}),
    "schedulefree-warmup": ("schedulefree", {"sf_warmup": 5, "sf_r": 1.0}, {"warmup_steps": 5, "r": 1.0}),
    "schedulefree-betas": ("schedulefree", {"betas": (0.5, 0.9), "weight_decay": 0.5},
                           {"betas": (0.5, 0.9), "weight_decay": 0.5}),
}


@pytest.fixture(scope="module")
def compiled():
    """``{optimizer: (compiled step, the state after STEPS steps with the constructor's values)}``, made on demand."""
    made = {}

    def get(opt: str, **structure):
        key = (opt, tuple(sorted(structure.items())))
        if key not in made:
            params, batches = problem()
            step = build(opt, **structure)
            cstep = ft.compile(step, backend="aot_eager")
            made[key] = (cstep, run(cstep, step.init(params), batches))
            assert cstep.compiles == 1
        return made[key]

    return get


def check_change(compiled, opt, built_with, new, **structure):
    params, batches = problem()
    cstep, before = compiled(opt, **structure)
    step = build(opt, **structure)
    got = run(cstep, ft.set_hyper(step.init(params), **new), batches)
    assert cstep.compiles == 1, f"changing {new} compiled {cstep.compiles - 1} more graph(s)"
    fresh = build(opt, **{**structure, **built_with})
    eager = run(fresh, fresh.init(params), batches)
    # the value took effect: the old value's run differs, the new value's eager run agrees
    trained = lambda s: (s.params, s.ema)  # noqa: E731 - what training made (the hyper-parameters aside)
    assert not T.tree_allclose(trained(before), trained(eager), rtol=1e-4, atol=1e-6), f"{new} changed nothing here"
    assert T.tree_allclose(got, eager, rtol=1e-5, atol=1e-6), f"{new}: the reused graph differs from eager"
    # ... and bit for bit a fresh compile of the step built with it (one graph: the values are its inputs)
    fresh_c = ft.compile(fresh, backend="aot_eager")
    want = run(fresh_c, fresh.init(params), batches)
    assert T.tree_equal(got, want), f"{new}: the reused graph differs from a fresh compile"
    return got


@pytest.mark.parametrize("case", sorted(CHANGES))
def test_a_changed_hyper_parameter_compiles_nothing_and_equals_a_fresh_run(compiled, case):
    opt, built_with, new = CHANGES[case]
    check_change(compiled, opt, built_with, new)


def test_clip_value_bound_is_data(compiled):
    check_change(compiled, "adamw", {"clip_value": 0.01}, {"clip_value": {"value": 0.01}}, clip_value=1.0)


@pytest.mark.parametrize("change", [{"growth_interval": 1}, {"backoff_factor": 0.125}])
def test_loss_scale_settings_are_data(compiled, change):
    """fp16 on the CPU, a scale of 2**4 that grows every ``growth_interval`` finite steps: the scale's path (and so
    the params, through the skipped updates and the unscaling's rounding) depends on both settings."""
    params, batches = problem()
    batches = [(x * (1e4 if i == 2 else 1), y) for i, (x, y) in enumerate(batches)]  # one overflow: a backoff
    cstep, _ = compiled("adamw", fp16=True)
    step = build("adamw", fp16=True)
    got = run(cstep, ft.set_hyper(step.init(params), mixed_precision=change), batches)
    assert cstep.compiles == 1
    base = run(step, step.init(params), batches)
    fresh = build("adamw", fp16=True, **change)
    eager = run(fresh, fresh.init(params), batches)
    assert float(base.loss_scale.scale) != float(eager.loss_scale.scale)  # the setting matters here
    assert float(got.loss_scale.scale) == float(eager.loss_scale.scale)
    assert T.tree_allclose(got, eager, rtol=1e-5, atol=1e-6)


def test_set_hyper_refuses_what_the_state_does_not_hold():
    params, _ = problem()
    state = build("adamw").init(params)
    with pytest.raises(ValueError, match=r"nothing in this state holds \['momentum'\]"):
        ft.set_hyper(state, momentum=0.9)  # AdamW has no momentum: named, and what it holds listed
    with pytest.raises(ValueError, match="another kind of schedule"):
        ft.set_hyper(state, lr=schedules.warmup_linear_decay(1e-3, 3, 100))  # the formula is the step's
    with pytest.raises(ValueError, match="a schedule's constants"):
        ft.set_hyper(state, lr=1e-3)  # a number where the step has a schedule
    with pytest.raises(ValueError, match="NaN"):
        ft.set_hyper(state, eps=float("nan"))
    with pytest.raises(ValueError, match="as a dict"):
        ft.set_hyper(state, clip=0.5)
    with pytest.raises(ValueError, match=r"'ema' slot has no \['gamma'\]"):
        ft.set_hyper(state, ema={"gamma": 1.0})
    # sgd without momentum has no buffer: its momentum is the step's structure, not a value to change
    plain = ft.train_step(ftt.mlp_loss, ft.optim.sgd(0.1)).init(params)
    with pytest.raises(ValueError, match="momentum"):
        ft.set_hyper(plain, momentum=0.9)
    # ... and so is a weight decay of 0 (a decay term held as data changed how inductor scheduled a remat step)
    for opt in (ft.optim.sgd(0.1), ft.optim.adam(1e-3), ft.optim.lion(1e-4)):
        with pytest.raises(ValueError, match=r"weight_decay of 0 at construction is the step's structure"):
            ft.set_hyper(ft.train_step(ftt.mlp_loss, opt).init(params), weight_decay=0.1)
    decayed = ft.set_hyper(ft.train_step(ftt.mlp_loss, ft.optim.sgd(0.1, weight_decay=1e-4)).init(params),
                           weight_decay=0.0)  # built with a decay: any value, 0 included
    assert float(ft.get_hyper(decayed)["weight_decay"]) == 0.0


def test_set_hyper_leaves_the_state_it_was_given_alone():
    params, _ = problem()
    state = build("adamw").init(params)
    new = ft.set_hyper(state, lr={"total_steps": 4000}, eps=1e-3, ema={"decay": 0.5})
    old = ft.get_hyper(state)
    assert float(old["lr"]["warmup_cosine"]["total_steps"]) == 12
    assert float(old["eps"]) == 1e-8 and float(old["ema"]["decay"]) == 0.8
    h = ft.get_hyper(new)
    assert float(h["lr"]["warmup_cosine"]["total_steps"]) == 4000 and float(h["eps"]) == 1e-3
    assert float(h["ema"]["decay"]) == 0.5 and float(h["clip"]["max_norm"]) == 0.5
    assert new.params is state.params and new.opt_state.exp_avg is state.opt_state.exp_avg  # nothing else copied


class ForeachAsLoops(torch.overrides.TorchFunctionMode):
    """``torch._foreach_<op>(lists, ...)`` as a loop of ``torch.<op>`` per tensor (in-place ops computed out of place
    and copied in)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if not name.startswith("_foreach_"):
            return func(*args, **kwargs)
        op = name[len("_foreach_"):]
        n = len(next(a for a in args if isinstance(a, (list, tuple))))
        rows = list(zip(*[a if isinstance(a, (list, tuple)) else [a] * n for a in args]))
        if op.endswith("_"):
            for row in rows:
                row[0].copy_(getattr(torch, op[:-1])(*row, **kwargs))
            return None
        return [getattr(torch, op)(*row, **kwargs) for row in rows]


def test_a_population_of_hyper_parameters_under_vmap_equals_each_member_alone():
    """A value of shape ``(n,)`` per member (as ``ft.population`` stacks them) under ``torch.func.vmap``: the
    update reads no Python number from a tensor value (no ``float()``, ``.item()`` or branch)."""
    params, batches = problem()
    opt = ft.optim.adamw(schedules.warmup_cosine(2e-2, 2, 10), weight_decay=0.1)
    lrs, b2s = torch.tensor([1e-2, 3e-2, 5e-2], dtype=torch.float64), torch.tensor([0.9, 0.99, 0.999],
                                                                                      dtype=torch.float64)
    grads = [T.tree_map(lambda p, i=i: torch.randn(p.shape, generator=torch.Generator().manual_seed(i)), params)
             for i in range(3)]

    def member(i):
        state = ft.set_hyper(opt.init(params), lr={"peak": float(lrs[i])}, beta2=float(b2s[i]))
        p = params
        for g in grads:
            p, state = opt.update(g, state, p)
        return p

    stacked_p = T.tree_map(lambda x: x.expand(3, *x.shape).clone(), params)
    state = opt.init(params)
    state = T.tree_map(lambda x: x.expand(3, *x.shape).clone(), state)
    state = ft.set_hyper(state, lr={"peak": lrs}, beta2=b2s)
    update = torch.func.vmap(lambda g, s, p: opt.update(g, s, p), in_dims=(None, 0, 0))
    with ForeachAsLoops():  # as ft.population runs its vmap: vmap batches the per-tensor ops, not every foreach op
        for g in grads:
            stacked_p, state = update(g, state, stacked_p)
    for i in range(3):
        assert T.tree_allclose({k: v[i] for k, v in stacked_p.items()}, member(i), rtol=1e-5, atol=1e-7)


# A second process, as a user's second run: the main job's transforms (warm-up + cosine, Adam, clip, EMA) built with
# other numbers, the run 10x longer, compiled with inductor on the first one's cache folder.
CHILD = r"""
import json, sys
import torch
import functrain as ft
import functrain.testing as ftt
from torch._dynamo.utils import counters
peak, warmup, total, b2, eps, norm, decay, cache = sys.argv[1:]
torch.manual_seed(0)
params = {"w0": torch.randn(6, 8) / 6**0.5, "b0": torch.zeros(8), "w1": torch.randn(8, 3) / 8**0.5, "b1": torch.zeros(3)}
batch = (torch.randn(8, 6), torch.randn(8, 3))
opt = ft.optim.adam(ft.optim.schedules.warmup_cosine(float(peak), int(warmup), int(total)), betas=(0.9, float(b2)),
                    eps=float(eps))
step = ft.ema(float(decay))(ft.clip(float(norm))(ft.train_step(ftt.mlp_loss, opt)))
cstep = ft.compile(step, cache_dir=cache)
got = want = step.init(params)
for _ in range(int(warmup) + 2):
    got, _ = cstep(got, batch)
    want, _ = step(want, batch)
print(json.dumps({"hit": counters["inductor"]["fxgraph_cache_hit"], "miss": counters["inductor"]["fxgraph_cache_miss"],
                  "equal": bool(ft.tree.tree_allclose(got, want, rtol=1e-5, atol=1e-6)),
                  "ema0": float(got.ema["b1"][0])}))
"""


def _child(tmp_path, *args):
    import json
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"}
    env.update(OMP_NUM_THREADS="1", FUNCTRAIN_CACHE_DIR=str(tmp_path / "memo"))
    proc = subprocess.run([sys.executable, "-c", CHILD, *map(str, args), str(tmp_path / "cache")], env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_a_second_run_with_other_numbers_and_length_loads_the_first_runs_graph(tmp_path):
    """The first process compiles (a miss); the second, with every number changed (peak lr, warm-up, a 10x longer
    horizon, beta2, eps, clip's norm, the EMA's decay), traces the same graph and loads it from inductor's cache
    (a hit, no miss): the numbers are inputs of the graph. Each equals its own eager run."""
    first = _child(tmp_path, 1e-2, 2, 400, 0.999, 1e-8, 1.0, 0.9)
    assert first["miss"] == 1 and first["hit"] == 0 and first["equal"], first
    second = _child(tmp_path, 3e-2, 3, 4000, 0.99, 1e-6, 0.5, 0.5)
    assert second["hit"] == 1 and second["miss"] == 0 and second["equal"], second
    assert first["ema0"] != second["ema0"]  # (and the numbers did change what was trained)


def test_a_resume_takes_the_checkpoints_values_and_copy_hyper_the_configurations(tmp_path):
    """A checkpoint holds the values it trained with (state is data); a run resumed with other numbers (a longer
    run) takes its configuration's with ``copy_hyper`` from a fresh ``init``, everything else from the file."""
    from functrain.core.hyper import copy_hyper

    params, batches = problem()
    step = build("adamw")
    state = run(step, step.init(params), batches[:3])
    ft.save(tmp_path / "c", state)
    longer = build("adamw", total_steps=4000, ema_decay=0.5)
    fresh = longer.init(params)
    loaded = ft.load(tmp_path / "c", fresh)
    assert float(ft.get_hyper(loaded)["lr"]["warmup_cosine"]["total_steps"]) == 12  # the checkpoint's
    resumed = copy_hyper(loaded, fresh)
    assert T.tree_equal(ft.get_hyper(resumed), ft.get_hyper(fresh))
    assert T.tree_equal(resumed.params, state.params) and T.tree_equal(resumed.opt_state.exp_avg, state.opt_state.exp_avg)
    with pytest.raises(ValueError, match="different hyper-parameters"):
        copy_hyper(loaded, build("sgd").init(params))
