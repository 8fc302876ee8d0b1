"""Graph breaks are named, early: the operation and the user's line, in the blocking and the background path.

Before: ``.item()`` traced into a graph inductor could not compile (torch's ``DataDependentOutputException`` in
blocking mode; in background mode a worker spent its time on it and the one warning read
"AssertionError: unpickle_state.fake_mode.shape_env is not set"); ``print`` compiled silently and printed once.
"""
import inspect
import time
import warnings

import pytest
import torch

import functrain as ft


def _line(fn, marker):
    """The line number of ``fn``'s source line holding ``marker``."""
    lines, first = inspect.getsourcelines(fn)
    return first + next(i for i, text in enumerate(lines) if marker in text)


def loss_item(p, b, x):
    y = (p["w"] * x).sum()
    v = y.item()  # HOST-READ
    return y * v


def loss_item_unused(p, b, x):
    y = (p["w"] * x).sum()
    y.item()  # HOST-READ
    return y


def loss_tolist(p, b, x):
    y = (p["w"] * x).sum()
    v = y.reshape(1).tolist()  # HOST-READ
    return y * v[0]


def loss_print(p, b, x):
    y = (p["w"] * x).sum()
    print("the loss is", y)  # HOST-READ
    return y


def loss_if(p, b, x):
    y = (p["w"] * x).sum()
    if y > 0:  # HOST-READ
        return y
    return -y


def loss_mask(p, b, x):
    y = (p["w"] * x).sum()
    return x[x > 0].sum() * y  # HOST-READ


CASES = [(loss_item, "item", "`.item()` reads a tensor's value on the host"),
         (loss_item_unused, "item", "`.item()` reads a tensor's value on the host"),
         (loss_tolist, "tolist", "`.tolist()` reads a tensor's values on the host"),
         (loss_print, "print", "`print` in the step runs once, while it is traced"),
         (loss_if, "__bool__", "a Python branch on a tensor's value"),
         (loss_mask, "__getitem__", "indexing with a boolean mask (`x[mask]`) makes a tensor whose size depends")]


def _problem(loss):
    step = ft.train_step(loss, ft.optim.sgd(0.1))
    return step, step.init({"w": torch.ones(4)}), torch.tensor([1.0, -2.0, 3.0, 0.5])


@pytest.mark.parametrize("loss, what, words", CASES, ids=[c[0].__name__ for c in CASES])
def test_a_graph_break_raises_naming_the_op_and_the_users_line(loss, what, words):
    step, state, x = _problem(loss)
    with pytest.raises(ft.GraphBreakError) as e:
        ft.compile(step, background=False)(state, x)
    line = _line(loss, "# HOST-READ")
    assert e.value.what == what
    assert e.value.where.file == __file__ and e.value.where.line == line and e.value.where.function == loss.__name__
    assert str(e.value).startswith("the step cannot be compiled as one graph (fullgraph=True): " + words)
    assert f"{__file__}:{line} in {loss.__name__}" in str(e.value)


def test_an_item_of_a_constant_is_no_graph_break():
    """A scalar read of a constant (``torch.tensor(2.0).item()``) is a number at the trace: compiled as before."""
    def loss(p, b, x):
        return (p["w"] * x).sum() * torch.tensor(2.0).item()

    step, state, x = _problem(loss)
    new, _ = ft.compile(step, background=False, backend="aot_eager")(state, x)
    ref, _ = step(state, x)
    assert torch.equal(new.params["w"], ref.params["w"])


@pytest.mark.parametrize("loss", [loss_item, loss_print], ids=["item", "print"])
def test_in_background_the_trace_finds_it_warns_once_with_the_same_words_and_trains_eagerly(monkeypatch, loss):
    """No job is pickled for a graph that can never compile; the warning carries GraphBreakError's words; the
    phase is "failed" everywhere from the trace on; the steps equal the eager step's."""
    from functrain.compiler import worker

    pickled = []
    real = worker.job_payload
    monkeypatch.setattr(worker, "job_payload", lambda *a, **k: pickled.append(1) or real(*a, **k))
    step, state, x = _problem(loss)
    with pytest.raises(ft.GraphBreakError) as blocking:
        ft.compile(step, background=False)(state, x)
    cstep = ft.compile(step, background=True)
    ref = state
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        deadline = time.monotonic() + 600  # the trace waits for the compiler's imports (a thread): eager steps first
        while not (cstep.progress is not None and cstep.progress.traced) and time.monotonic() < deadline:
            state, _ = cstep(state, x)
            ref, _ = step(ref, x)
        assert cstep.progress.traced, cstep.progress
        assert cstep.progress.phase == "failed", cstep.progress
        for _ in range(3):
            state, _ = cstep(state, x)
            ref, _ = step(ref, x)
    said = [str(w.message) for w in caught if "background compile failed" in str(w.message)]
    assert len(said) == 1, said
    assert str(blocking.value).split(" The tracer")[0] in said[0]
    assert cstep.progress.reason.startswith("GraphBreakError: the step cannot be compiled as one graph")
    assert pickled == [] and cstep.progress.workers == 0
    assert torch.equal(state.params["w"], ref.params["w"])
