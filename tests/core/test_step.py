"""The eager step: purity, the reference math, errors, functionalize/to_module, the transform protocol."""
import pytest
import torch
from hypothesis import given, settings, strategies as st

import functrain as ft
from functrain import tree as T


def mlp(sizes=(5, 16, 3), dropout=0.0, bn=False):
    layers = []
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
        layers.append(torch.nn.Linear(a, b))
        if i < len(sizes) - 2:
            if bn:
                layers.append(torch.nn.BatchNorm1d(b))
            layers.append(torch.nn.Tanh())
            if dropout:
                layers.append(torch.nn.Dropout(dropout))
    return torch.nn.Sequential(*layers)


def make(model, optimizer=None):
    apply_fn, params, buffers = ft.functionalize(model)

    def loss_fn(params, buffers, batch):
        x, y = batch
        return torch.nn.functional.cross_entropy(apply_fn(params, buffers, x), y)

    return ft.train_step(loss_fn, optimizer or ft.optim.adamw(1e-2)), params, buffers


def batch(n=8, d=5, k=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, d, generator=g), torch.randint(0, k, (n,), generator=g)


@settings(max_examples=10)
@given(st.integers(1, 12), st.integers(0, 1000), st.booleans())
def test_step_equals_torch_optim_loop(n, seed, bn):
    """The step's math equals the hand-written loop: backward + torch.optim.AdamW."""
    torch.manual_seed(seed)
    model = mlp(bn=bn)
    ref = mlp(bn=bn)
    ref.load_state_dict(model.state_dict())
    step, params, buffers = make(model, ft.optim.adamw(1e-2, weight_decay=0.1))
    state = step.init({k: v.clone() for k, v in params.items()}, {k: v.clone() for k, v in buffers.items()})
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    for i in range(3):
        b = batch(max(n, 2) if bn else n, seed=seed + i)
        state, metrics = step(state, b)
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(ref(b[0]), b[1])
        loss.backward()
        opt.step()
        torch.testing.assert_close(metrics["loss"], loss.detach(), rtol=1e-6, atol=1e-6)
    for k, v in ref.named_parameters():
        torch.testing.assert_close(state.params[k], v.detach(), rtol=0, atol=1e-6)
    for k, v in ref.named_buffers():  # BatchNorm statistics advance as in the module
        torch.testing.assert_close(state.buffers[k], v, rtol=0, atol=1e-6)


def test_step_is_pure_and_deterministic():
    step, params, buffers = make(mlp(bn=True, dropout=0.3))
    step = ft.ema(0.9, warmup=False)(ft.clip(1.0)(step))
    state = step.init(params, buffers)
    b = batch()
    before = T.tree_map(torch.clone, (state, b))
    s1, m1 = step(state, b)
    s2, m2 = step(state, b)
    assert T.tree_equal((state, b), before), "the step wrote into its inputs"
    assert T.tree_equal(s1, s2) and T.tree_equal(m1, m2), "same input state twice gave different outputs"
    assert not T.tree_equal(s1.params, state.params)
    assert int(s1.step) == 1 and int(state.step) == 0


def test_dropout_is_reproducible_from_the_state():
    step, params, buffers = make(mlp(dropout=0.5))
    s0 = step.init(params, buffers, seed=7)
    torch.manual_seed(123)
    a, _ = step(s0, batch())
    torch.manual_seed(456)  # the global RNG does not matter ...
    b, _ = step(s0, batch())
    assert T.tree_equal(a, b)
    c, _ = step(a, batch())  # ... the state's does: the next step draws new numbers
    d, _ = step(step.init(params, buffers, seed=8), batch())
    assert not T.tree_equal(a.params, d.params)
    assert not T.tree_equal(a.rng, c.rng)
    # and the caller's global generator is left as it was
    torch.manual_seed(5)
    expected = torch.rand(3)
    torch.manual_seed(5)
    step(s0, batch())
    assert torch.equal(torch.rand(3), expected)


def test_aux_metrics_and_num_items():
    apply_fn, params, buffers = ft.functionalize(torch.nn.Linear(4, 1))

    def loss_fn(params, buffers, batch):
        x, y, mask = batch
        err = (apply_fn(params, buffers, x).squeeze(-1) - y) ** 2 * mask
        return err.sum(), {"num_items": mask.sum(), "max_err": err.max()}

    step = ft.train_step(loss_fn, ft.optim.sgd(0.1))
    x, y = torch.randn(6, 4), torch.randn(6)
    mask = torch.tensor([1.0, 1, 0, 1, 0, 0])
    state = step.init(params, buffers)
    new, metrics = step(state, (x, y, mask))
    assert set(metrics) >= {"loss", "num_items", "max_err", "lr"}
    assert float(metrics["num_items"]) == 3.0

    # reference: the masked mean loss, plain SGD by hand
    def mean_loss(params):
        err = (apply_fn(params, buffers, x).squeeze(-1) - y) ** 2 * mask
        return err.sum() / mask.sum()

    grads = torch.func.grad(mean_loss)(params)
    torch.testing.assert_close(metrics["loss"], mean_loss(params))
    for k in params:
        torch.testing.assert_close(new.params[k], params[k] - 0.1 * grads[k])


def test_functionalize_and_to_module_roundtrip():
    model = mlp(bn=True)
    model.eval()
    apply_fn, params, buffers = ft.functionalize(model)
    x = torch.randn(4, 5)
    torch.testing.assert_close(apply_fn(params, buffers, x), model(x))
    assert all(params[k].data_ptr() == p.data_ptr() for k, p in model.named_parameters())  # no copy
    new = {k: v + 1 for k, v in params.items()}
    target = mlp(bn=True).eval()
    ft.to_module(target, new, buffers)
    torch.testing.assert_close(target(x), apply_fn(new, buffers, x))
    with pytest.raises(KeyError, match="nope"):
        ft.to_module(target, {"nope": torch.zeros(1)})
    with pytest.raises(ValueError, match="shape"):
        ft.to_module(target, {"0.weight": torch.zeros(2, 2)})
    with pytest.raises(TypeError, match="nn.Module"):
        ft.functionalize(lambda x: x)


def test_tied_weights_train_once():
    class Tied(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(7, 4)
            self.out = torch.nn.Linear(4, 7, bias=False)
            self.out.weight = self.emb.weight

        def forward(self, t):
            return self.out(self.emb(t))

    model = Tied()
    apply_fn, params, buffers = ft.functionalize(model)
    assert sorted(params) == ["emb.weight"]
    step = ft.train_step(lambda p, b, t: torch.nn.functional.cross_entropy(apply_fn(p, b, t), t), ft.optim.sgd(0.5))
    t = torch.randint(0, 7, (9,))
    new, _ = step(step.init(params, buffers), t)
    ref = Tied()
    ref.load_state_dict(model.state_dict())
    torch.nn.functional.cross_entropy(ref(t), t).backward()
    torch.testing.assert_close(new.params["emb.weight"], ref.emb.weight - 0.5 * ref.emb.weight.grad)


# -- errors --------------------------------------------------------------------------------
def test_loss_must_be_scalar():
    step = ft.train_step(lambda p, b, x: p["w"] * x, ft.optim.sgd(0.1))
    with pytest.raises(ValueError, match=r"scalar loss.*shape \(3,\)"):
        step(step.init({"w": torch.ones(3)}), torch.ones(3))
    step = ft.train_step(lambda p, b, x: 3.0, ft.optim.sgd(0.1))
    with pytest.raises(TypeError, match="scalar tensor.*float"):
        step(step.init({"w": torch.ones(3)}), torch.ones(3))
    step = ft.train_step(lambda p, b, x: (p["w"].sum(), [1]), ft.optim.sgd(0.1))
    with pytest.raises(TypeError, match="aux must be a dict"):
        step(step.init({"w": torch.ones(3)}), torch.ones(3))


def test_params_must_be_floating_tensors():
    step = ft.train_step(lambda p, b, x: p["w"].sum(), ft.optim.sgd(0.1))
    with pytest.raises(TypeError, match=r"'n'.*int64"):
        step.init({"w": torch.ones(3), "n": torch.ones(3, dtype=torch.int64)})
    with pytest.raises(TypeError, match=r"'w'.*float"):
        step.init({"w": 1.0})
    with pytest.raises(ValueError, match="empty"):
        step.init({})


def test_batch_must_be_tensors():
    step = ft.train_step(lambda p, b, x: p["w"].sum(), ft.optim.sgd(0.1))
    state = step.init({"w": torch.ones(3)})
    with pytest.raises(TypeError, match=r"leaf '1'.*str"):
        step(state, (torch.ones(3), "hello"))
    with pytest.raises(TypeError, match="TrainState"):
        step({"params": {}}, torch.ones(3))


def test_bad_constructors():
    with pytest.raises(TypeError, match="loss_fn must be callable"):
        ft.train_step(3, ft.optim.sgd(0.1))
    with pytest.raises(TypeError, match="functrain optimizer"):
        ft.train_step(lambda p, b, x: x, torch.optim.SGD)
    with pytest.raises(TypeError, match="transforms a functrain Step"):
        ft.clip(1.0)(lambda s, b: s)
    with pytest.raises((TypeError, ValueError), match="schedule|callable"):
        ft.optim.adamw(lr="fast")


def test_transform_applied_twice_is_an_error():
    step = ft.train_step(lambda p, b, x: p["w"].sum(), ft.optim.sgd(0.1))
    with pytest.raises(ValueError, match="'clip' is already applied"):
        ft.clip(1.0)(ft.ema(0.9, warmup=False)(ft.clip(2.0)(step)))
    with pytest.raises(ValueError, match="'accumulate' is already applied"):
        ft.accumulate(2, streaming=True)(ft.accumulate(2)(step))
    assert ft.clip(1.0)(step) is not step and step.transforms == ()


class Scale(ft.Transform):
    """A user transform per the documented protocol: scales gradients, counts its calls."""

    name = "scale"
    order = 50

    def __init__(self, factor):
        self.factor = factor

    def init(self, params, buffers):
        return {"calls": torch.zeros((), dtype=torch.int64)}

    def transform(self, ctx):
        ctx.grads = ft.tree.tree_scale(ctx.grads, self.factor)
        ctx.set_slot(self, {"calls": ctx.slot(self)["calls"] + 1})


def test_custom_transform_composes_with_builtins():
    step, params, buffers = make(mlp(), ft.optim.sgd(0.1))
    b = batch()
    # the wrapping order does not matter: clip (order 10) always runs before scale (order 50)
    step_a, step_b = Scale(0.5)(ft.clip(0.3)(step)), ft.clip(0.3)(Scale(0.5)(step))
    s_a, m_a = step_a(step_a.init(params, buffers), b)
    s_b, m_b = step_b(step_b.init(params, buffers), b)
    assert T.tree_equal(s_a, s_b)
    assert int(s_a.slots["scale"]["calls"]) == 1
    # reference: the plain gradient, clipped by norm 0.3, then halved
    grads = torch.func.grad(lambda p: step.loss_fn(p, buffers, b))(params)
    norm = T.global_norm(grads)
    torch.testing.assert_close(m_a["grad_norm"], norm)
    coef = min(1.0, 0.3 / (float(norm) + 1e-6)) * 0.5
    for k in params:
        torch.testing.assert_close(s_a.params[k], params[k] - 0.1 * coef * grads[k], rtol=1e-6, atol=1e-7)
