"""ft.run: the loop, device placement, log-only host syncs."""
import numpy as np
import pytest
import torch


import functrain as ft
from conftest import CountHostPulls  # noqa: F401 - shared with tests/trainer and test_driver_hooks
from functrain import tree as T


def problem():
    apply_fn, params, buffers = ft.functionalize(torch.nn.Linear(3, 1))

    def loss_fn(params, buffers, batch):
        x, y = batch
        return torch.nn.functional.mse_loss(apply_fn(params, buffers, x), y)

    step = ft.train_step(loss_fn, ft.optim.sgd(0.1))
    g = torch.Generator().manual_seed(0)
    data = [(torch.randn(4, 3, generator=g), torch.randn(4, 1, generator=g)) for _ in range(5)]
    return step, step.init(params, buffers), data




def test_run_equals_manual_loop_and_cycles_epochs():
    step, state, data = problem()
    expected = state
    for b in data + data[:2]:
        expected, _ = step(expected, b)
    got = ft.run(step, state, data, num_steps=7, progress=False)
    assert T.tree_equal(expected, got)
    assert int(got.step) == 7
    one_pass = ft.run(step, state, data, progress=False)
    assert int(one_pass.step) == 5


def test_metrics_reach_the_host_only_on_log_steps():
    step, state, data = problem()
    seen = []

    with CountHostPulls() as mode:  # the step runs inside too: it must not pull anything itself
        ft.run(step, state, data * 2, log_every=4, progress=False, on_log=lambda i, m: seen.append((i, m)))
    assert [i for i, _ in seen] == [4, 8, 10]  # every 4th step and the last
    n_metrics = len(seen[0][1])
    assert mode.pulls == 3 * n_metrics  # one pull per metric per log, none on other steps
    assert isinstance(seen[0][1]["loss"], float)


def test_numpy_batches_are_converted_and_moved():
    step, state, data = problem()
    np_data = [(x.numpy(), y.numpy()) for x, y in data]
    a = ft.run(step, state, np_data, progress=False)
    b = ft.run(step, state, data, progress=False)
    assert T.tree_equal(a, b)
    moved = ft.to_device({"x": np.ones(2, dtype=np.float32), "n": 3}, "cpu")
    assert torch.is_tensor(moved["x"]) and moved["n"] == 3


def test_progress_bar_and_bad_arguments(capsys):
    pytest.importorskip("tqdm")
    step, state, data = problem()
    ft.run(step, state, data, num_steps=3, progress=True, log_every=1)
    with pytest.raises(ValueError, match="log_every"):
        ft.run(step, state, data, log_every=0)
    with pytest.raises(ValueError, match="num_steps"):
        ft.run(step, state, data, num_steps=-1)
    with pytest.raises(TypeError, match="TrainState"):
        ft.run(step, {"params": 1}, data)
