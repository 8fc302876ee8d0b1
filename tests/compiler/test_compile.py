"""ft.compile: compiled == eager, one graph, no recompiles, donation, clear errors.

Inductor compiles cost 10-30 s each on a small CPU, so each compiled step is
built once per module (fixtures) and shared by the tests that need it.
"""
import pytest
import torch

from conftest import donating_loop

import functrain as ft
from functrain import tree as T


class TinyTransformer(torch.nn.Module):
    def __init__(self, vocab=17, d=16, heads=2, seq=8):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, d)
        self.pos = torch.nn.Parameter(torch.randn(seq, d) * 0.1)
        self.block = torch.nn.TransformerEncoderLayer(d, heads, dim_feedforward=32, dropout=0.0, batch_first=True,
                                                bias=False)  # a key bias has an exactly-zero gradient
        self.norm = torch.nn.LayerNorm(d)
        self.head = torch.nn.Linear(d, vocab)

    def forward(self, tokens):
        h = self.emb(tokens) + self.pos[: tokens.shape[1]]
        return self.head(self.norm(self.block(h)))


def transformer_problem():
    torch.manual_seed(0)
    model = TinyTransformer()
    apply_fn, params, buffers = ft.functionalize(model)

    def loss_fn(params, buffers, tokens):
        logits = apply_fn(params, buffers, tokens[:, :-1])
        return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))

    sched = ft.optim.schedules.warmup_cosine(3e-3, warmup_steps=5, total_steps=40)
    step = ft.train_step(loss_fn, ft.optim.adamw(sched, weight_decay=0.01))
    batches = [torch.randint(0, 17, (4, 9), generator=torch.Generator().manual_seed(i)) for i in range(20)]
    return step, step.init(params, buffers), batches


def mlp_problem(dropout=0.0):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Dropout(dropout), torch.nn.Linear(32, 1))
    apply_fn, params, buffers = ft.functionalize(model)

    def loss_fn(params, buffers, batch):
        x, y = batch
        return torch.nn.functional.mse_loss(apply_fn(params, buffers, x), y)

    step = ft.train_step(loss_fn, ft.optim.adamw(1e-2, betas=(0.9, 0.99)))
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(16, 8, generator=g), torch.randn(16, 1, generator=g)) for _ in range(20)]
    return step, step.init(params, buffers), batches


def run_steps(fn, state, batches):
    metrics = []
    for b in batches:
        state, m = fn(state, b)
        metrics.append(m)
    return state, metrics


@pytest.fixture(scope="module")
def mlp_dropout():
    # fallback_random makes inductor draw random numbers as eager torch does, so that
    # compiled == eager holds with dropout too
    step, state, batches = mlp_problem(dropout=0.2)
    cstep = ft.compile(step, options={"fallback_random": True})
    return step, cstep, state, batches, run_steps(cstep, state, batches)


def test_mlp_compiled_equals_eager_with_dropout(mlp_dropout):
    step, cstep, state, batches, (cstate, cmetrics) = mlp_dropout
    estate, emetrics = run_steps(step, state, batches)
    assert T.tree_allclose(estate, cstate, rtol=1e-5, atol=1e-6)
    for e, c in zip(emetrics, cmetrics):
        torch.testing.assert_close(e["loss"], c["loss"], rtol=1e-5, atol=1e-6)
    assert T.tree_equal(estate.rng, cstate.rng)  # the same random numbers were drawn


def test_mlp_no_recompiles_over_20_steps(mlp_dropout):
    _, cstep, state, batches, _ = mlp_dropout
    assert cstep.compiles == 1, f"{cstep.compiles} graphs for 20 steps of the same shapes"


def test_compiled_step_is_pure_and_reproducible(mlp_dropout):
    _, cstep, state, batches, _ = mlp_dropout
    before = T.tree_map(torch.clone, state)
    a = cstep(state, batches[0])
    b = cstep(state, batches[0])
    assert T.tree_equal(state, before)
    assert T.tree_equal(a, b)
    assert cstep.compiles == 1


def test_transformer_compiled_equals_eager():
    """Each compiled step equals the eager step from the same state, and 20 free-running steps agree.

    (The attention has no biases: a key bias's gradient is exactly zero in eager
    arithmetic and rounding noise when compiled, and Adam turns that noise into
    updates of size lr, a difference of the test model, not of the step.)
    """
    step, state, batches = transformer_problem()
    cstep = ft.compile(step)
    s = state
    for b in batches:
        expected, em = step(s, b)
        got, cm = cstep(s, b)
        assert T.tree_allclose(expected.params, got.params, rtol=1e-5, atol=1e-6)
        assert T.tree_allclose(expected.opt_state, got.opt_state, rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(em["loss"], cm["loss"], rtol=1e-5, atol=1e-6)
        s = expected
    assert cstep.compiles == 1, f"{cstep.compiles} graphs for 20 steps of the same shapes"
    cstate, cmetrics = run_steps(cstep, state, batches)
    estate, emetrics = run_steps(step, state, batches)
    assert T.tree_allclose(estate.params, cstate.params, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(torch.stack([m["loss"] for m in emetrics]),
                               torch.stack([m["loss"] for m in cmetrics]), rtol=1e-5, atol=1e-5)
    assert float(emetrics[-1]["loss"]) < float(emetrics[0]["loss"])  # it trains
    assert cstep.compiles == 1


def test_donation_reuses_storage_and_invalidates_the_input():
    step, state, batches = mlp_problem()
    step = ft.ema(0.9, warmup=False)(step)
    state = step.init(T.tree_map(torch.clone, state.params), state.buffers)
    expected, _ = run_steps(step, state, batches[:3])
    cstep = ft.compile(step, donate=True)  # the same law as test_fast_path's, through inductor
    s = donating_loop(cstep, state, batches[:3], refused_by=(step,))
    assert T.tree_allclose(expected, s, rtol=1e-5, atol=1e-6)
    assert cstep.compiles == 1


def test_graph_break_is_reported_clearly():
    def loss_fn(params, buffers, x):
        loss = (params["w"] * x).sum()
        if loss.item() > 0:  # a host sync: cannot be one graph
            return loss
        return -loss

    step = ft.train_step(loss_fn, ft.optim.sgd(0.1))
    cstep = ft.compile(step, backend="eager")
    with pytest.raises(ft.GraphBreakError, match="fullgraph=True"):
        cstep(step.init({"w": torch.ones(3)}), torch.ones(3))


def test_user_errors_surface_through_compile():
    step = ft.train_step(lambda p, b, x: p["w"] * x, ft.optim.sgd(0.1))
    with pytest.raises(ValueError, match="scalar loss"):
        ft.compile(step, backend="eager")(step.init({"w": torch.ones(3)}), torch.ones(3))
    with pytest.raises(TypeError, match="functrain Step"):
        ft.compile(lambda s, b: (s, {}))


@pytest.fixture(scope="module")
def aot_mlp():
    """An aot_eager compiled MLP step that has compiled once (for the bad-batch tests)."""
    step, state, batches = mlp_problem()
    step = ft.accumulate(2)(step)
    cstep = ft.compile(step, backend="aot_eager")
    cstep(state, batches[0])
    return step, cstep, state, batches


def eager_error(step, state, batch):
    with pytest.raises(Exception) as info:
        step(state, batch)
    return info.value


@pytest.mark.parametrize("case", ["features", "structure", "indivisible"])
def test_bad_batch_to_a_compiled_step_raises_the_users_error(aot_mlp, case):
    """A batch the step cannot take raises what the eager step raises (same type, same message), not
    Dynamo's fake-tensor report; the compiled step keeps working afterwards without recompiling."""
    step, cstep, state, batches = aot_mlp
    x, y = batches[0]
    bad = {"features": (x[:, :7], y), "structure": (x, y, y), "indivisible": (x[:15], y[:15])}[case]
    expected = eager_error(step, state, bad)
    with pytest.raises(type(expected)) as info:
        cstep(state, bad)
    assert str(info.value) == str(expected)
    assert not isinstance(info.value, torch._dynamo.exc.TorchDynamoException)
    assert info.value.__cause__ is None and info.value.__suppress_context__  # no Dynamo chain
    before = cstep.compiles
    cstep(state, batches[1])
    assert cstep.compiles == before == 1
