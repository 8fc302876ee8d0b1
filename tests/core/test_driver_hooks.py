"""ft.run's hooks for the trainer: on_step (device metrics, stop), start (numbering, log steps), no host sync."""
import pytest
import torch

import functrain as ft
from functrain import tree as T

from conftest import CountHostPulls
from test_driver import problem


def test_on_step_sees_every_step_and_stops_the_loop():
    step, state, data = problem()
    seen, logged = [], []

    def on_step(i, s, metrics):
        seen.append((i, int(s.step), torch.is_tensor(metrics["loss"])))
        return i == 4

    got = ft.run(step, state, data * 3, num_steps=10, log_every=3, progress=False, on_step=on_step,
                 on_log=lambda i, m: logged.append(i))
    assert seen == [(i, i, True) for i in range(1, 5)]
    assert int(got.step) == 4
    assert logged == [3, 4]  # the stop step is logged although 4 is not a log step
    expected = state
    for b in data[:4]:
        expected, _ = step(expected, b)
    assert T.tree_equal(got, expected)


def test_start_numbers_the_steps_and_places_the_log_steps():
    step, state, data = problem()
    seen, logged = [], []
    ft.run(step, state, data, num_steps=5, log_every=4, start=6, progress=False,
           on_step=lambda i, s, m: seen.append(i), on_log=lambda i, m: logged.append(i))
    assert seen == [7, 8, 9, 10, 11]
    assert logged == [8, 11]  # divisible by log_every, and the last (start + num_steps)


def test_on_step_adds_no_host_sync():
    step, state, data = problem()
    flags = []
    with CountHostPulls() as mode:
        ft.run(step, state, data * 2, log_every=4, progress=False, on_step=lambda i, s, m: flags.append(m["loss"]))
    with CountHostPulls() as plain:
        ft.run(step, state, data * 2, log_every=4, progress=False)
    assert len(flags) == 10 and mode.pulls == plain.pulls


def test_progress_bar_counts_from_start(capsys):
    pytest.importorskip("tqdm")
    step, state, data = problem()
    ft.run(step, state, data, num_steps=2, start=3, log_every=1)
    err = capsys.readouterr().err
    assert "3/5" in err  # the bar starts at start, out of start + num_steps


def test_bad_hooks_and_start():
    step, state, data = problem()
    with pytest.raises(ValueError, match="start must be an int >= 0"):
        ft.run(step, state, data, start=-1, progress=False)
    with pytest.raises(TypeError, match="on_step must be callable"):
        ft.run(step, state, data, on_step=3, progress=False)
