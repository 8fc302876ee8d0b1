"""A stateful transform written outside functrain, with only the public protocol.

``SmoothGrads`` is defined here and nowhere in functrain: its own NamedTuple slot
type (registered for checkpoints in this file), an accessor on the state, and a
hook. It trains eagerly and compiled (against a reference computed by hand), is
checkpointed with ft.save, resumes bit-exactly with ft.load, and a step without
it refuses its state, naming the slot. No functrain file knows its name.
"""
from __future__ import annotations

import pathlib
from typing import Any, NamedTuple

import pytest
import torch

import functrain as ft
import functrain.testing as ftt
from functrain.core.tree import tree_equal

NAME = "smooth_grads"


@ft.register_checkpoint_type("tests.outside.SmoothState")
class SmoothState(NamedTuple):
    """The slot: the running average of the gradients and the number of updates it has seen."""

    grads: Any
    count: torch.Tensor


class SmoothGrads(ft.Transform):
    """Replace the gradient by an exponential average of the gradients (stage ``transform``):
    ``m = beta * m + (1 - beta) * g``, then the optimizer sees ``m``."""

    name = NAME
    order = 60
    accessors = {"smoothed_grads": lambda slot: slot.grads}

    def __init__(self, beta: float):
        self.beta = beta

    def init(self, params, buffers) -> SmoothState:
        device = ft.tree.tree_leaves(params)[0].device
        return SmoothState(ft.tree.tree_zeros_like(params), torch.zeros((), dtype=torch.int64, device=device))

    def transform(self, ctx) -> None:
        old: SmoothState = ctx.slot(self)
        avg = ft.tree.tree_map(lambda m, g: self.beta * m + (1 - self.beta) * g, old.grads, ctx.grads)
        ctx.grads = avg
        ctx.set_slot(self, SmoothState(avg, old.count + 1))


def problem():
    gen = torch.Generator().manual_seed(3)
    params = {"w": torch.randn(5, 3, generator=gen) / 5**0.5, "b": torch.zeros(3)}
    batches = [(torch.randn(8, 5, generator=gen), torch.randn(8, 3, generator=gen)) for _ in range(6)]
    return params, batches


def loss_fn(params, buffers, batch):
    x, y = batch
    return torch.nn.functional.mse_loss(x @ params["w"] + params["b"], y)


def make_step(with_smooth=True):
    step = ft.clip(1.0)(ft.train_step(loss_fn, ft.optim.sgd(0.1)))
    return SmoothGrads(0.8)(step) if with_smooth else step


@pytest.fixture(scope="module")
def compiled():
    """One compiled step for the module (aot_eager: one graph, eager's kernels)."""
    return ft.compile(make_step(), backend="aot_eager")


def run(step, state, batches):
    for b in batches:
        state, _ = step(state, b)
    return state


def test_trains_eagerly_as_computed_by_hand():
    params, batches = problem()
    step = make_step()
    state = step.init(params)
    ref_p = {k: v.clone() for k, v in params.items()}
    ref_m = {k: torch.zeros_like(v) for k, v in params.items()}
    for b in batches:
        state, metrics = step(state, b)
        g = torch.func.grad(lambda p: loss_fn(p, {}, b))(ref_p)
        norm = torch.sqrt(sum((x.double() ** 2).sum() for x in g.values()))
        coef = min(1.0, 1.0 / (float(norm) + 1e-6))  # clip (order 10) runs before the transform (60)
        ref_m = {k: 0.8 * ref_m[k] + 0.2 * (g[k] * coef) for k in g}
        ref_p = {k: ref_p[k] - 0.1 * ref_m[k] for k in g}
    ftt.assert_same_state(state.params, ref_p, rtol=1e-5, atol=1e-6)
    ftt.assert_same_state(state.smoothed_grads, ref_m, rtol=1e-5, atol=1e-6)  # its own accessor
    assert type(state.slots[NAME]) is SmoothState and int(state.slots[NAME].count) == len(batches)
    assert make_step(False).init(params).smoothed_grads is None  # no slot: None, as state.ema


def test_compiled_equals_eager(compiled):
    params, batches = problem()
    step = compiled.step
    ftt.assert_compiled_equals_eager(step, step.init(params), lambda i: batches[i], steps=len(batches),
                                     compiled=compiled)


@pytest.mark.parametrize("mode", ["eager", "compiled"])
def test_checkpoint_resumes_bit_exactly(tmp_path, compiled, mode):
    params, batches = problem()
    step = make_step() if mode == "eager" else compiled
    uninterrupted = run(step, step.init(params), batches)

    half = run(step, step.init(params), batches[:3])
    ft.save(tmp_path / "ckpt", half)
    for loaded in (ft.load(tmp_path / "ckpt"), ft.load(tmp_path / "ckpt", step.init(params))):
        assert type(loaded.slots[NAME]) is SmoothState  # restored as its own type, by its registered name
        assert tree_equal(loaded, half)
        resumed = run(step, loaded, batches[3:])
        assert tree_equal(resumed, uninterrupted), f"{mode}: resume differs from the uninterrupted run"


def test_refused_on_resume_without_the_transform(tmp_path, compiled):
    params, batches = problem()
    state = run(make_step(), make_step().init(params), batches[:2])
    ft.save(tmp_path / "ckpt", state)
    plain = make_step(with_smooth=False)
    loaded = ft.load(tmp_path / "ckpt")
    want = f"state.slots has '{NAME}' but this step has no '{NAME}' transform"
    with pytest.raises(ValueError, match=want):
        plain.check_state(loaded)
    with pytest.raises(ValueError, match=want):
        plain(loaded, batches[2])
    cplain = ft.compile(plain, backend="aot_eager")
    with pytest.raises(ValueError, match=want):
        cplain(loaded, batches[2])
    assert cplain.compiles == 0  # refused before anything was traced
    with pytest.raises(ft.CheckpointError, match=NAME):  # and with a template of the other step
        ft.load(tmp_path / "ckpt", plain.init(params))
    # the other way round: the transform's step refuses a state without its slot
    ft.save(tmp_path / "plain", plain.init(params))
    with pytest.raises(ValueError, match=f"state.slots lacks '{NAME}'.*SmoothState"):
        compiled(ft.load(tmp_path / "plain"), batches[0])


def test_no_functrain_file_names_the_transform():
    """The transform needed no edit to functrain: nothing in the package names it or its slot."""
    root = pathlib.Path(ft.__file__).parent
    for path in root.rglob("*.py"):
        text = path.read_text()
        for word in (NAME, "SmoothState", "SmoothGrads", "smoothed_grads"):
            assert word not in text, f"{path} mentions {word}"
