"""random_flip(p, dim, key): each row flipped where its uniform draw is < p, drawn from the step's generator
(seeded by the state's key), inside the step: the same flips eager and compiled, from the same state."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import functrain as ft
from conftest import FAST


def _seen_loss(store):
    """A loss that records the batch it saw (eager only) and depends on it."""
    def loss_fn(params, buffers, x):
        if not torch.compiler.is_compiling():
            store.append(x.detach().clone())
        return (params["w"] * x).sum()
    return loss_fn


@FAST
@given(rows=st.integers(1, 9), width=st.integers(1, 6), p=st.floats(0.0, 1.0), seed=st.integers(0, 2**40),
       dim=st.sampled_from([-1, -2, 1]))
def test_flip_law_rows_selected_by_the_steps_draw(rows, width, p, seed, dim):
    """The loss sees x.flip(dim)[i] where u_i < p, x[i] otherwise, with u = torch.rand(rows) drawn from the generator
    the step seeds from state.rng: reproduced here by seeding the same way (with_rng's step seed)."""
    from functrain.core.rng import step_seed

    seen = []
    step = ft.random_flip(p, dim=dim)(ft.train_step(_seen_loss(seen), ft.optim.sgd(0.0)))
    x = torch.randn(rows, 2, 3, width)
    state = step.init({"w": torch.zeros(2, 3, width)}, seed=seed)
    step(state, x)
    gen = torch.Generator().manual_seed(step_seed(seed, 0))
    u = torch.rand(rows, generator=gen)
    expected = torch.where((u < p).view(-1, 1, 1, 1), x.flip(dim), x)
    assert torch.equal(seen[0], expected)
    again = []
    ft.random_flip(p, dim=dim)(ft.train_step(_seen_loss(again), ft.optim.sgd(0.0)))(state, x)
    assert torch.equal(again[0], seen[0])  # the same state: the same flips


def test_each_micro_batch_draws_its_own_flips_and_compiled_equals_eager():
    """Under accumulate(2) the flip acts per micro-batch; aot_eager (eager kernels, the same generator) gives the same
    params as the eager step over several steps, and the graph has the flip's random op (one graph, no recompile)."""
    def loss_fn(params, buffers, x):
        return ((params["w"] * x).sum(dim=(1, 2, 3)) ** 2).mean()

    step = ft.accumulate(2)(ft.random_flip()(ft.train_step(loss_fn, ft.optim.sgd(0.01))))
    state = step.init({"w": torch.linspace(-1, 1, 5).expand(1, 2, 5).clone()}, seed=3)
    x = torch.randn(8, 1, 2, 5)
    cstep = ft.compile(step, backend="aot_eager")
    a, b = state, state
    for _ in range(4):
        a, _ = step(a, x)
        b, _ = cstep(b, x)
    assert torch.allclose(a.params["w"], b.params["w"], rtol=1e-6, atol=1e-7)
    assert cstep.compiles == 1
    assert not torch.equal(a.params["w"], ft.train_step(loss_fn, ft.optim.sgd(0.01)).init(state.params).params["w"])


def test_flip_of_a_dict_or_tuple_item_and_the_errors():
    seen = []
    loss = lambda p, b, batch: (p["w"] * batch["img"]).sum() + 0 * batch["y"].sum()  # noqa: E731
    step = ft.random_flip(1.0, key="img")(ft.train_step(loss, ft.optim.sgd(0.0)))
    img = torch.arange(6.0).view(1, 1, 2, 3)
    state, _ = step(step.init({"w": torch.ones(1, 2, 3)}), {"img": img, "y": torch.ones(1)})
    tup = ft.random_flip(1.0, key=0)(ft.train_step(lambda p, b, batch: _seen_loss(seen)(p, b, batch[0]),
                                                   ft.optim.sgd(0.0)))
    tup(tup.init({"w": torch.ones(1, 2, 3)}), (img, torch.ones(1)))
    assert torch.equal(seen[0], img.flip(-1))
    with pytest.raises(ValueError, match=r"random_flip\(key='img'\): the batch has keys \['x'\]"):
        step(step.init({"w": torch.ones(1, 2, 3)}), {"x": img})
    with pytest.raises(ValueError, match=r"random_flip\(dim=-1\) flips rows of a tensor.*got a tensor of shape \(3,\)"):
        plain = ft.random_flip()(ft.train_step(lambda p, b, x: (p["w"] * x).sum(), ft.optim.sgd(0.0)))
        plain(plain.init({"w": torch.ones(3)}), torch.ones(3))
    with pytest.raises(ValueError, match="dim must not be 0"):
        ft.random_flip(dim=0)
    with pytest.raises(ValueError, match=r"p must be a number in \[0, 1\]; got 1.5"):
        ft.random_flip(1.5)
    assert "random_flip" not in state.slots  # stateless: no slot
