"""run_steps: ft.run's loop as an iterator (what the Trainer loops over): the same steps and log steps as ft.run,
host reads at log steps only, a stop's log read on demand, the bar and Ctrl-C handler closed however the loop ends."""
import signal

import pytest
import torch

import functrain as ft
from functrain import tree as T
from functrain.driver import Steps, run_steps

from conftest import CountHostPulls
from test_driver import problem


def test_the_iterator_runs_run_s_steps_and_reads_the_host_at_log_steps_only():
    step, state, data = problem()
    logged, pulled = [], []
    expected = ft.run(step, state, data * 2, log_every=4, progress=False, on_log=lambda i, m: logged.append((i, m)))
    with CountHostPulls() as mode:
        with run_steps(step, state, data * 2, log_every=4, progress=False) as steps:
            assert isinstance(steps, Steps)
            for i, new, metrics, host in steps:
                assert torch.is_tensor(metrics["loss"]) and torch.is_tensor(new.step)  # (no read here)
                if host is not None:
                    pulled.append((i, host))
    assert [i for i, _ in pulled] == [i for i, _ in logged] == [4, 8, 10]  # every 4th step and the last
    assert [h["loss"] for _, h in pulled] == [m["loss"] for _, m in logged]
    assert mode.pulls == 3 * len(pulled[0][1])  # one pull per metric per log step, none on the others
    assert steps.logged and steps.index == int(steps.state.step) == 10 and T.tree_equal(steps.state, expected)


def test_a_break_is_a_stop_whose_metrics_log_reads_and_start_numbers_the_steps():
    step, state, data = problem()
    with run_steps(step, state, data, num_steps=5, log_every=4, start=6, progress=False) as steps:
        seen = []
        for i, _, _, host in steps:
            seen.append((i, host is not None))
            if i == 9:
                break
        assert seen == [(7, False), (8, True), (9, False)]
        assert not steps.logged
        with CountHostPulls() as mode:
            host = steps.log()
        assert steps.logged and isinstance(host["loss"], float) and mode.pulls == len(host)
    assert steps.index == 9 and int(steps.state.step) == 3  # (the state counts its own steps: 3 run here)
    with pytest.raises(ValueError, match="no step has run yet"):
        run_steps(step, state, data, progress=False).log()


def test_the_ctrl_c_handler_is_put_back_after_a_break_and_after_an_error():
    if signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        pytest.skip("Python's own Ctrl-C handler is not in place here")
    step, state, data = problem()
    with run_steps(step, state, data, progress=False) as steps:
        next(steps)
        assert signal.getsignal(signal.SIGINT) is not signal.default_int_handler  # the loop's own, while it runs
        for _ in steps:
            break
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler

    def failing(s, batch):
        raise RuntimeError("a bad batch")

    with pytest.raises(RuntimeError, match="a bad batch"):
        for _ in run_steps(failing, state, data, progress=False):  # (no with: the failing loop closes itself)
            pass
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_bad_arguments_are_refused_as_run_refuses_them():
    step, state, data = problem()
    with pytest.raises(ValueError, match="log_every must be an int >= 1"):
        run_steps(step, state, data, log_every=0)
    with pytest.raises(ValueError, match="start must be an int >= 0"):
        run_steps(step, state, data, start=-1)
    with pytest.raises(TypeError, match="TrainState"):
        run_steps(step, {"params": 1}, data)
