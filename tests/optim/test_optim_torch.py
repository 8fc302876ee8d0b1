"""Your torch.optim optimizer in functrain: translated ports (bitwise), schedulers as tables, schedule-free
against the real package, the escape hatch, stepped state handed over, and what is refused by name."""
from __future__ import annotations

import copy
import warnings

import optree
import pytest
import schedulefree
import torch
import transformers
from torch.optim import lr_scheduler as L

import functrain as ft
from functrain.optim import GroupedState, TorchStepState

from test_optim import bits_equal

STEPS = 12


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(5, 6)
        self.ln = torch.nn.LayerNorm(6)
        self.head = torch.nn.Linear(6, 2)
        self.frozen = torch.nn.Parameter(torch.ones(3), requires_grad=False)

    def forward(self, x):
        return self.head(torch.tanh(self.ln(self.fc(x))))


def twins(seed=0):
    """Two identical models: one for torch.optim, one for functrain."""
    torch.manual_seed(seed)
    a = Net()
    b = copy.deepcopy(a)
    return a, b


def batches(n=STEPS, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(8, 5, generator=g), torch.randn(8, 2, generator=g)) for _ in range(n)]


def grads_for(model, seed=2, n=STEPS):
    g = torch.Generator().manual_seed(seed)
    return [{k: torch.randn(p.shape, generator=g) for k, p in model.named_parameters() if p.requires_grad}
            for _ in range(n)]


def torch_run(model, torch_opt, grads, scheduler=None):
    """torch.optim's own loop with the given gradients; returns the lrs of group 0..n per update."""
    named = dict(model.named_parameters())
    lrs = []
    for g in grads:
        lrs.append([group["lr"] for group in torch_opt.param_groups])
        for k, v in g.items():
            named[k].grad = v.clone()
        torch_opt.step()
        if scheduler is not None:
            scheduler.step()
    return {k: p.detach().clone() for k, p in model.named_parameters() if p.requires_grad}, lrs


def ft_run(opt, model, grads, state=None):
    _, params, _ = ft.functionalize(model)
    state = opt.init(params) if state is None else state
    for g in grads:
        params, state = opt.update(g, state, params)
    return params, state


def groups_of(model, **second):
    """Two param groups: the weights, and the biases and norm (with the group's own hyper-parameters)."""
    decay = [model.fc.weight, model.head.weight]
    rest = [model.fc.bias, model.ln.weight, model.ln.bias, model.head.bias]
    return [{"params": decay}, {"params": rest, **second}]


CASES = {
    "sgd": (torch.optim.SGD, dict(lr=0.05), dict(lr=0.02)),
    "sgd_momentum_wd": (torch.optim.SGD, dict(lr=0.05, momentum=0.9, weight_decay=0.1), dict(weight_decay=0.0)),
    "sgd_nesterov": (torch.optim.SGD, dict(lr=0.03, momentum=0.8, nesterov=True), dict(lr=0.07, momentum=0.6)),
    "sgd_dampening_maximize": (torch.optim.SGD, dict(lr=0.05, momentum=0.9, dampening=0.3, maximize=True),
                               dict(lr=0.01)),
    "adam": (torch.optim.Adam, dict(lr=1e-2, weight_decay=0.05), dict(lr=3e-3, betas=(0.8, 0.99), eps=1e-6)),
    "adam_maximize": (torch.optim.Adam, dict(lr=1e-2, maximize=True), dict(weight_decay=0.1)),
    "adam_decoupled": (torch.optim.Adam, dict(lr=1e-2, weight_decay=0.1, decoupled_weight_decay=True),
                       dict(weight_decay=0.0)),
    "adamw": (torch.optim.AdamW, dict(lr=2e-2, betas=(0.85, 0.95), weight_decay=0.2),
              dict(lr=7e-3, weight_decay=0.0)),
    "adamw_foreach": (torch.optim.AdamW, dict(lr=2e-2, foreach=True), dict(lr=3e-3, eps=1e-5)),
}


@pytest.mark.parametrize("name", list(CASES))
def test_translation_with_param_groups_is_bitwise_torch(name):
    cls, kw, second = CASES[name]
    theirs, ours = twins()
    grads = grads_for(theirs)
    expected, _ = torch_run(theirs, cls(groups_of(theirs, **second), **kw), grads)
    opt = ft.optim.from_torch(cls(groups_of(ours, **second), **kw))     # names matched at init (memory)
    params, state = ft_run(opt, ours, grads)
    assert isinstance(state, GroupedState) and int(state.count) == STEPS and len(state.groups) == 2
    assert bits_equal(params, expected)
    assert opt.per_param
    # the model, its Parameters and the torch optimizer are left as they were
    assert torch.equal(ours.fc.weight, twins()[0].fc.weight)


@pytest.mark.parametrize("name", ["sgd_momentum_wd", "adamw"])
def test_one_group_over_every_param_keeps_the_ports_own_state(name):
    cls, kw, _ = CASES[name]
    theirs, ours = twins()
    grads = grads_for(theirs)
    expected, _ = torch_run(theirs, cls([p for p in theirs.parameters() if p.requires_grad], **kw), grads)
    opt = ft.optim.check_optimizer(cls(ours.parameters(), **kw))  # the frozen param too: it has no gradient
    params, state = ft_run(opt, ours, grads)
    assert type(state).__name__ in ("SGDState", "AdamState") and not opt.per_param
    assert bits_equal(params, expected)


def test_a_param_the_optimizer_does_not_hold_is_not_updated():
    theirs, ours = twins()
    grads = grads_for(theirs)
    expected, _ = torch_run(theirs, torch.optim.AdamW(theirs.head.parameters(), lr=0.01), grads)
    opt = ft.optim.from_torch(torch.optim.AdamW(ours.head.parameters(), lr=0.01), ours)
    params, state = ft_run(opt, ours, grads)
    assert isinstance(state, GroupedState) and opt.per_param  # known from the module: only the head is held
    assert bits_equal(params, expected)
    assert torch.equal(params["fc.weight"], ours.fc.weight.detach())


def test_train_step_with_a_torch_optimizer_and_scheduler_trains_as_torch():
    """End to end: ft.train_step(loss, (AdamW with groups, CosineAnnealingLR)) equals torch's loop bit for bit."""
    theirs, ours = twins()
    t_opt = torch.optim.AdamW(groups_of(theirs, weight_decay=0.0, lr=3e-3), lr=1e-2, weight_decay=0.1)
    t_sched = L.CosineAnnealingLR(t_opt, T_max=STEPS)
    o_opt = torch.optim.AdamW(groups_of(ours, weight_decay=0.0, lr=3e-3), lr=1e-2, weight_decay=0.1)
    apply_fn, params, buffers = ft.functionalize(ours)

    def loss_fn(p, b, batch):
        x, y = batch
        return torch.nn.functional.mse_loss(apply_fn(p, b, x), y)

    step = ft.train_step(loss_fn, (o_opt, L.CosineAnnealingLR(o_opt, T_max=STEPS)))
    state = step.init(params, buffers)
    lrs = []
    for x, y in batches():
        lrs.append([g["lr"] for g in t_opt.param_groups])
        t_opt.zero_grad()
        torch.nn.functional.mse_loss(theirs(x), y).backward()
        t_opt.step()
        t_sched.step()
        assert float(step.optimizer.learning_rate(state.opt_state)) == lrs[-1][0]
        state, _ = step(state, (x, y))
    assert bits_equal(state.params, {k: p.detach() for k, p in theirs.named_parameters() if p.requires_grad})


# ------------------------------------------------------------------------------------------ schedulers
SCHEDULERS = {
    "LambdaLR": (lambda o: L.LambdaLR(o, lambda t: 0.95 ** t), STEPS),
    "LambdaLR_per_group": (lambda o: L.LambdaLR(o, [lambda t: 1 / (t + 1), lambda t: 0.5 + t % 3]), STEPS),
    "StepLR": (lambda o: L.StepLR(o, step_size=3, gamma=0.5), STEPS),
    "MultiStepLR": (lambda o: L.MultiStepLR(o, milestones=[2, 7], gamma=0.3), None),
    "ExponentialLR": (lambda o: L.ExponentialLR(o, gamma=0.9), STEPS),
    "CosineAnnealingLR": (lambda o: L.CosineAnnealingLR(o, T_max=7, eta_min=1e-4), STEPS),
    "LinearLR": (lambda o: L.LinearLR(o, start_factor=0.1, total_iters=5), None),
    "OneCycleLR": (lambda o: L.OneCycleLR(o, max_lr=[0.1, 0.05], total_steps=STEPS, cycle_momentum=False), None),
    "SequentialLR": (lambda o: L.SequentialLR(o, [L.LinearLR(o, 0.2, total_iters=4), L.CosineAnnealingLR(o, 8)],
                                              milestones=[4]), None),
    "CosineAnnealingWarmRestarts": (lambda o: L.CosineAnnealingWarmRestarts(o, T_0=4, T_mult=2), STEPS),
    "CyclicLR": (lambda o: L.CyclicLR(o, 0.01, [0.1, 0.05], step_size_up=3, cycle_momentum=False), STEPS),
    "ChainedScheduler": (lambda o: L.ChainedScheduler([L.ConstantLR(o, 0.5, total_iters=3), L.ExponentialLR(o, 0.9)]),
                         STEPS),
    "PolynomialLR": (lambda o: L.PolynomialLR(o, total_iters=6, power=2.0), None),
    "MultiplicativeLR": (lambda o: L.MultiplicativeLR(o, lambda t: 0.97), STEPS),
    "hf_cosine": (lambda o: transformers.get_scheduler("cosine", o, num_warmup_steps=3, num_training_steps=STEPS),
                  None),
    "hf_linear": (lambda o: transformers.get_scheduler("linear", o, num_warmup_steps=4, num_training_steps=STEPS),
                  None),
}


@pytest.mark.parametrize("name", list(SCHEDULERS))
def test_scheduler_lrs_and_params_are_torchs(name):
    make, num_steps = SCHEDULERS[name]
    theirs, ours = twins()
    grads = grads_for(theirs)
    t_opt = torch.optim.SGD(groups_of(theirs, lr=0.02), lr=0.1, momentum=0.9)
    expected, torch_lrs = torch_run(theirs, t_opt, grads, make(t_opt))
    o_opt = torch.optim.SGD(groups_of(ours, lr=0.02), lr=0.1, momentum=0.9)
    sched = make(o_opt)
    tables = ft.optim.from_torch_scheduler(sched, num_steps=num_steps)
    assert [[float(s(t)) for s in tables] for t in range(STEPS)] == torch_lrs      # the same floats
    assert [[float(s(torch.tensor(t))) for s in tables] for t in range(STEPS)] == torch_lrs
    opt = ft.optim.from_torch(o_opt, ours, scheduler=sched, num_steps=num_steps)
    params, _ = ft_run(opt, ours, grads)
    assert bits_equal(params, expected)
    assert o_opt.param_groups[0]["lr"] == torch_lrs[0][0]  # the scheduler is not stepped
    assert sched.state_dict().get("last_epoch", 0) == 0


def test_scheduler_horizons():
    o = torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=1.0)
    assert ft.optim.from_torch_scheduler(L.OneCycleLR(o, 1.0, total_steps=50, cycle_momentum=False))[0].total_steps == 50
    o = torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=1.0)
    hf = transformers.get_scheduler("cosine", o, num_warmup_steps=2, num_training_steps=40)
    assert ft.optim.from_torch_scheduler(hf)[0].total_steps == 40
    o = torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=1.0)
    linear, = ft.optim.from_torch_scheduler(L.LinearLR(o, 0.5, total_iters=3))
    assert linear.total_steps is None and float(linear(10_000)) == float(linear(3))  # constant after: any run
    o = torch.optim.AdamW([torch.nn.Parameter(torch.ones(1))], lr=1.0)
    opt = ft.optim.from_torch(o, scheduler=L.StepLR(o, 2), num_steps=30)
    assert ft.optim.schedules.horizon(opt) == 30
    with pytest.raises(ValueError, match=r"built for 30 updates .* the run takes 31"):
        ft.optim.schedules.check_covers(opt, 31)


def test_a_stepped_optimizer_and_scheduler_continue_where_they_are():
    theirs, _ = twins()
    grads = grads_for(theirs, n=2 * STEPS)
    t_opt = torch.optim.AdamW(groups_of(theirs, lr=0.02), lr=0.05)
    t_sched = L.StepLR(t_opt, 5, 0.5)
    torch_run(theirs, t_opt, grads[:STEPS], t_sched)
    model, o_opt, o_sched = copy.deepcopy((theirs, t_opt, t_sched))  # the same three after STEPS updates
    expected, lrs = torch_run(theirs, t_opt, grads[STEPS:], t_sched)
    opt = ft.optim.from_torch(o_opt, scheduler=o_sched, num_steps=2 * STEPS)
    _, params, _ = ft.functionalize(model)
    state = opt.init(params)
    assert int(state.count) == STEPS
    assert torch.equal(state.groups[0].exp_avg["fc.weight"], o_opt.state[model.fc.weight]["exp_avg"])
    assert [float(opt.learning_rate(state._replace(count=torch.tensor(STEPS + t)))) for t in range(STEPS)] == [
        r[0] for r in lrs]
    params, state = ft_run(opt, model, grads[STEPS:], state)
    assert bits_equal(params, expected)


@pytest.mark.parametrize("cls, kw", [(torch.optim.SGD, dict(lr=0.05, momentum=0.9, dampening=0.2)),
                                     (torch.optim.Adam, dict(lr=0.01)),
                                     (schedulefree.AdamWScheduleFree, dict(lr=0.02, warmup_steps=3))],
                         ids=["sgd", "adam", "schedulefree"])
def test_a_stepped_optimizer_hands_its_state_over(cls, kw):
    """A torch optimizer that has stepped: its moments / buffers / z and count seed the functional state, and
    the continuation is torch's, bit for bit."""
    theirs, _ = twins()
    grads = grads_for(theirs, n=2 * STEPS)
    t_opt = cls(groups_of(theirs, lr=kw["lr"] / 2), **kw)
    if cls is schedulefree.AdamWScheduleFree:
        t_opt.train()
    torch_run(theirs, t_opt, grads[:STEPS])
    mid = copy.deepcopy((theirs, t_opt))  # the same model and optimizer after STEPS updates
    expected, _ = torch_run(theirs, t_opt, grads[STEPS:])
    model, o_opt = mid
    opt = ft.optim.from_torch(o_opt)
    params, state = ft_run(opt, model, grads[STEPS:])
    assert int(state.count) == (2 * STEPS if cls is not torch.optim.SGD else STEPS + 1)
    assert bits_equal(params, expected)


# ------------------------------------------------------------------------------------------ schedule-free
SF_KW = dict(lr=0.05, betas=(0.9, 0.99), weight_decay=0.01, warmup_steps=4, r=0.5, weight_lr_power=2.0)


@pytest.mark.parametrize("path", ["port", "torch_step"])
def test_schedulefree_matches_the_package_bitwise_train_and_eval_weights(path):
    theirs, ours = twins()
    grads = grads_for(theirs)
    t_opt = schedulefree.AdamWScheduleFree(groups_of(theirs, lr=0.02, betas=(0.95, 0.999)), **SF_KW)
    t_opt.train()
    torch_run(theirs, t_opt, grads)
    y = {k: p.detach().clone() for k, p in theirs.named_parameters() if p.requires_grad}
    t_opt.eval()
    x = {k: p.detach().clone() for k, p in theirs.named_parameters() if p.requires_grad}
    o_opt = schedulefree.AdamWScheduleFree(groups_of(ours, lr=0.02, betas=(0.95, 0.999)), **SF_KW)
    if path == "torch_step":
        o_opt.train()
        opt = ft.optim.torch_step(o_opt, ours)
    else:
        opt = ft.optim.from_torch(o_opt)
    params, state = ft_run(opt, ours, grads)
    assert isinstance(state, TorchStepState if path == "torch_step" else GroupedState)
    assert bits_equal(params, y)
    assert bits_equal(opt.eval_params(params, state), x)
    assert not bits_equal(x, y)


def test_schedulefree_port_in_a_step_eval_params_and_checkpoint(tmp_path):
    from functrain import checkpoint
    model = torch.nn.Linear(3, 2)
    apply_fn, params, buffers = ft.functionalize(model)
    step = ft.train_step(lambda p, b, batch: apply_fn(p, b, batch).square().mean(),
                         ft.optim.adamw_schedulefree(0.1, warmup_steps=2))
    state = step.init(params, buffers)
    for x in batches(4):
        state, _ = step(state, x[0][:, :3])
    x = ft.optim.eval_params(step, state)
    assert bits_equal(x, step.optimizer.eval_params(state.params, state.opt_state)) and not bits_equal(x, state.params)
    plain = ft.train_step(lambda p, b, batch: apply_fn(p, b, batch).sum(), ft.optim.adamw(0.1))
    assert ft.optim.eval_params(plain, plain.init(params, buffers)) is params
    checkpoint.save(tmp_path / "ck", state.opt_state)
    assert bits_equal(checkpoint.load(tmp_path / "ck"), state.opt_state)
    with pytest.raises(ValueError, match=r"betas\[0\] must be > 0"):
        ft.optim.adamw_schedulefree(0.1, betas=(0.0, 0.9))


# ------------------------------------------------------------------------------------------ compiled
@pytest.mark.parametrize("kind", ["adamw_steplr", "schedulefree"])
def test_translated_step_compiles_as_one_graph(kind):
    model = torch.nn.Linear(5, 2)
    apply_fn, params, buffers = ft.functionalize(model)
    if kind == "schedulefree":
        torch_opt = (schedulefree.AdamWScheduleFree(model.parameters(), lr=0.05, warmup_steps=2), None)
    else:
        o = torch.optim.AdamW(model.parameters(), lr=0.05)
        torch_opt = (o, L.StepLR(o, 2, 0.5))
    step = ft.train_step(lambda p, b, batch: torch.nn.functional.mse_loss(apply_fn(p, b, batch[0]), batch[1]),
                         ft.optim.from_torch(torch_opt[0], scheduler=torch_opt[1], num_steps=6))
    eager = compiled = step.init(params, buffers)
    cstep = ft.compile(step, background=False)
    for batch in batches(6):
        eager, eager_metrics = step(eager, batch)
        compiled, metrics = cstep(compiled, batch)
        assert float(metrics["lr"]) == float(eager_metrics["lr"])
    for k in params:
        torch.testing.assert_close(compiled.params[k], eager.params[k], rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------------------------------ the escape hatch
@pytest.mark.parametrize("cls, kw", [(torch.optim.RMSprop, dict(lr=0.01, momentum=0.5, centered=True)),
                                     (torch.optim.Adagrad, dict(lr=0.1, initial_accumulator_value=0.1)),
                                     (torch.optim.Adam, dict(lr=0.01, amsgrad=True)),
                                     (torch.optim.NAdam, dict(lr=0.01))],
                         ids=["rmsprop", "adagrad", "adam_amsgrad", "nadam"])
def test_any_optimizer_runs_by_its_own_step_bitwise(cls, kw):
    theirs, ours = twins()
    grads = grads_for(theirs)
    t_opt = cls(groups_of(theirs, lr=kw["lr"] / 3), **kw)
    expected, _ = torch_run(theirs, t_opt, grads, L.StepLR(t_opt, 4, 0.5))
    o_opt = cls(groups_of(ours, lr=kw["lr"] / 3), **kw)
    opt = (ft.optim.torch_step if cls is torch.optim.Adam else ft.optim.from_torch)(
        o_opt, ours, scheduler=L.StepLR(o_opt, 4, 0.5), num_steps=STEPS)
    half, state = ft_run(opt, ours, grads[:STEPS // 2])
    assert isinstance(state, TorchStepState) and opt.per_param
    # a resume from a copy of the state (what a checkpoint holds) continues the same, bit for bit
    state = ft.tree.tree_map(torch.clone, state)
    for g in grads[STEPS // 2:]:
        half, state = opt.update(g, state, half)
    assert bits_equal(half, expected)
    assert int(state.count) == STEPS
    assert o_opt.state == {} or cls is torch.optim.Adagrad  # the user's optimizer never stepped
    assert torch.equal(ours.fc.weight, twins()[0].fc.weight)


def test_the_escape_hatch_is_refused_where_it_cannot_hold():
    model = torch.nn.Linear(3, 1)
    apply_fn, params, buffers = ft.functionalize(model)
    step = ft.train_step(lambda p, b, x: apply_fn(p, b, x).sum(), torch.optim.RMSprop(model.parameters(), lr=0.1))
    state = step.init(params, buffers)
    with pytest.raises(ft.GraphBreakError, match=r"ft\.optim\.torch_step runs RMSprop\.step\(\) in Python on the "
                                                 r"host, which a compiled graph cannot hold"):
        ft.compile(step, background=False)(state, torch.ones(2, 3))
    with pytest.raises(ValueError, match=r"torch_step \(RMSprop\.step\(\)\) needs each param whole and by name; "
                                         r"these params are flat"):
        step.init(params, buffers, flat=True)
    with pytest.raises(ValueError, match=r"data_parallel\(shard='optimizer'\) updates flat per-dtype shards"):
        ft.data_parallel(shard="optimizer")(step)


@pytest.mark.parametrize("shard", ["optimizer", "params"])
def test_a_sharded_step_takes_one_group_named_from_the_module(shard):
    model = torch.nn.Linear(3, 2)
    apply_fn, params, buffers = ft.functionalize(model)

    def loss(p, b, x):
        return apply_fn(p, b, x).square().mean()

    lazy = ft.data_parallel(shard=shard)(ft.train_step(loss, torch.optim.AdamW(model.parameters(), lr=0.1)))
    with pytest.raises(ValueError, match=r"AdamW translated: these params are flat .*named with "
                                         r"ft\.optim\.from_torch\(torch_optimizer, model\)"):
        lazy.init(params, buffers)
    named = ft.optim.from_torch(torch.optim.AdamW(model.parameters(), lr=0.1), model)
    sharded = ft.data_parallel(shard=shard)(ft.train_step(loss, named))
    plain = ft.train_step(loss, ft.optim.adamw(0.1))
    a, b = sharded.init(params, buffers), plain.init(params, buffers)
    for _ in range(3):
        a, _ = sharded(a, torch.ones(4, 3))
        b, _ = plain(b, torch.ones(4, 3))
    assert bits_equal(ft.gather_state(a).params, b.params)


# ------------------------------------------------------------------------------------------ refusals
def _p():
    return [torch.nn.Parameter(torch.ones(2, 2)), torch.nn.Parameter(torch.ones(2))]


def test_what_a_port_does_not_hold_is_refused_by_name():
    with pytest.raises(ValueError, match=r"torch\.optim\.adam\.Adam param group 0: amsgrad=True: functrain's "
                                         r"adam/adamw have no AMSGrad .*ft\.optim\.torch_step\(optimizer\)"):
        ft.optim.check_optimizer(torch.optim.Adam(_p(), lr=1e-3, amsgrad=True))
    with pytest.raises(TypeError, match=r"AdamW param group 0: lr is a tensor .*build the optimizer with lr=<float>"):
        ft.optim.from_torch(torch.optim.AdamW(_p(), lr=torch.tensor(0.01)))
    with pytest.raises(ValueError, match=r"SGD param group 1: .*momentum must be a float >= 0; got -0\.5"):
        o = torch.optim.SGD(_p()[:1], lr=0.1)
        o.add_param_group({"params": _p()[1:]})
        o.param_groups[1]["momentum"] = -0.5
        ft.optim.from_torch(o)
    o = torch.optim.AdamW(_p(), lr=1e-3)
    with pytest.raises(ValueError, match=r"OneCycleLR changes 'betas' of param group 0 as it steps .*"
                                         r"cycle_momentum=False"):
        ft.optim.from_torch(o, scheduler=L.OneCycleLR(o, max_lr=0.01, total_steps=10))
    o = torch.optim.SGD(_p(), lr=0.1)
    with pytest.raises(ValueError, match=r"ReduceLROnPlateau follows a metric"):
        ft.optim.check_optimizer(L.ReduceLROnPlateau(o))
    with pytest.raises(ValueError, match=r"StepLR has no end of its own.*num_steps=N"):
        ft.train_step(lambda p, b, x: x, L.StepLR(o, 3))
    with pytest.raises(ValueError, match=r"the StepLR given schedules another optimizer"):
        ft.optim.from_torch(torch.optim.SGD(_p(), lr=0.1), scheduler=L.StepLR(o, 3))
    with pytest.raises(TypeError, match=r"torch\.optim\.sgd\.SGD is a torch\.optim optimizer class.*pass an instance"):
        ft.train_step(lambda p, b, x: x, torch.optim.SGD)
    with pytest.raises(TypeError, match=r"StepLR is a torch\.optim learning-rate scheduler class"):
        ft.optim.check_optimizer(L.StepLR)


def test_params_that_are_not_the_models_are_refused_with_the_way_out():
    model = torch.nn.Linear(3, 1)
    _, params, _ = ft.functionalize(model)
    copies = {k: v.clone() for k, v in params.items()}
    opt = ft.optim.check_optimizer(torch.optim.AdamW(model.parameters(), lr=0.01))
    with pytest.raises(ValueError, match=r"AdamW param 0 of param group 0 \(\(1, 3\) torch\.float32\) is none of the "
                                         r"params given to init .*ft\.optim\.from_torch\(torch_optimizer, model\)"):
        opt.init(copies)
    named = ft.optim.from_torch(torch.optim.AdamW(model.parameters(), lr=0.01), model)
    assert set(named.init(copies).exp_avg) == {"weight", "bias"}  # named from the module: copies are fine
    built_named = ft.optim.from_torch(torch.optim.AdamW(model.named_parameters(), lr=0.01))
    assert set(built_named.init(copies).exp_avg) == {"weight", "bias"}  # torch kept the names
    with pytest.raises(TypeError, match=r"from_torch: params must be the module, a dict"):
        ft.optim.from_torch(torch.optim.AdamW(model.parameters()), [model.weight])


def test_a_stepped_state_that_cannot_be_handed_over_is_refused():
    a, b = _p()
    o = torch.optim.Adam([a, b], lr=0.1)
    a.grad = torch.ones_like(a)
    o.step()  # b had no gradient: it has no state
    with pytest.raises(ValueError, match=r"Adam has stepped, but param 1 of param group 0 has no state while param 0"):
        ft.optim.from_torch(o)
    o = torch.optim.Adam(_p(), lr=0.1)
    with pytest.raises(ValueError, match=r"LambdaLR has stepped 1 times \(last_epoch\) but .*Adam 0 times"):
        s = L.LambdaLR(o, lambda t: 1.0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            s.step()
        ft.optim.from_torch(o, scheduler=s, num_steps=5)
    p = _p()
    o = schedulefree.AdamWScheduleFree(p, lr=0.1)
    o.train()
    for x in p:
        x.grad = torch.ones_like(x)
    o.step()
    o.eval()
    with pytest.raises(ValueError, match=r"AdamWScheduleFree has stepped and is in eval mode .*optimizer\.train\(\)"):
        ft.optim.from_torch(o)


# ------------------------------------------------------------------- a state that grows after the first update
class SGDThenEMA(torch.optim.SGD):
    """SGD that, from its ``start``-th update on, keeps an average of each weight (a state key made then, and a
    count in the param group) and pulls the weight toward it: a state that grows after the first update."""

    def __init__(self, params, lr, start=4, **kw):
        super().__init__(params, lr=lr, **kw)
        self.start = start

    @torch.no_grad()
    def step(self, closure=None):
        loss = super().step(closure)
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                st["n"] = st.get("n", 0) + 1
                if st["n"] < self.start:
                    continue
                if "ema" not in st:
                    st["ema"] = p.detach().clone()
                st["ema"].mul_(0.8).add_(p, alpha=0.2)
                p.lerp_(st["ema"], 0.5)
            if any("ema" in self.state[p] for p in group["params"]):
                group["ema_n"] = group.get("ema_n", 0) + 1
        return loss


class SGDWithSpikes(torch.optim.SGD):
    """SGD that keeps, once a gradient is large, a record of it: a key whose update depends on the data."""

    @torch.no_grad()
    def step(self, closure=None):
        loss = super().step(closure)
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None and float(p.grad.abs().max()) > 2.5:
                    self.state[p]["spike"] = p.grad.abs().max().clone()
        return loss


def test_a_state_that_grows_after_the_first_update_is_followed_bitwise(tmp_path):
    """The optimizer makes a state tensor and a group number at its 4th update: with layout_steps=4 the
    functrain state carries them from init on (one structure, so a checkpoint of update 2 loads with init's
    template and a skipped update's select holds) and every update is torch's own, bit for bit."""
    theirs, ours = twins()
    grads = grads_for(theirs)
    expected, _ = torch_run(theirs, SGDThenEMA(groups_of(theirs, lr=0.02), lr=0.05, momentum=0.9), grads)
    opt = ft.optim.torch_step(SGDThenEMA(groups_of(ours, lr=0.02), lr=0.05, momentum=0.9), ours, layout_steps=4)
    _, params, _ = ft.functionalize(ours)
    template = opt.init(params)
    assert sorted(template.state["fc.weight"]) == ["ema", "momentum_buffer", "n"]
    half, state = ft_run(opt, ours, grads[:2])
    assert not state.state["fc.weight"]["ema"].any()  # not made yet: its placeholder
    path = ft.save(str(tmp_path / "ckpt"), state)
    state = ft.load(path, template=template)  # what a resume does (the structure learnt at init)
    for g in grads[2:]:
        before = state
        half, state = opt.update(g, state, half)
        assert optree.tree_structure(state) == optree.tree_structure(before)
    assert bits_equal(half, expected)
    assert [int(g["ema_n"]) for g in state.groups] == [STEPS - 3] * 2


@pytest.mark.parametrize("cls, kw, message", [
    (SGDThenEMA, {}, r"SGDThenEMA\.step\(\) added the state 'ema' to param 'fc\.weight' at update 4: init learnt "
                     r"the keys from 1 step\(s\) on copies; pass ft\.optim\.torch_step\(optimizer, layout_steps=4\)"),
    (SGDThenEMA, dict(layout_steps=2), r"added the state 'ema' .* at update 4: init learnt the keys from 2 step"),
    (SGDWithSpikes, dict(layout_steps=STEPS), r"SGDWithSpikes\.step\(\) added the state 'spike' to param '[\w.]+' at "
                                              r"update \d+: .*its keys depend on the gradients"),
], ids=["late", "later", "data"])
def test_a_state_that_grows_where_init_did_not_learn_it_is_refused_by_name(cls, kw, message):
    """Before, such a key was dropped after each update (made afresh at the next): 2.0 off torch's own loop,
    silently."""
    theirs, ours = twins()
    opt = ft.optim.torch_step(cls(ours.parameters(), lr=0.05, momentum=0.9), ours, **kw)
    with pytest.raises(ValueError, match=message):
        ft_run(opt, ours, [{k: v * 3 for k, v in g.items()} for g in grads_for(theirs)])
    del theirs


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "4"])
def test_layout_steps_is_checked(bad):
    with pytest.raises(ValueError, match=rf"torch_step: layout_steps must be an int >= 1 .*; got {bad!r}"):
        ft.optim.torch_step(torch.optim.SGD(_p(), lr=0.1), layout_steps=bad)
