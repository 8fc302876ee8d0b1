"""ft.run's console on one process: a runner's bar shows each path's label with its rate and no ETA until the rate
of the path that will run is measured; lines logged during the run go above the bar, and the streams are given back
however the run ends."""
import logging
import sys
import types

import pytest

import functrain as ft
from functrain.compiler.progress import PhaseRates, Progress
from functrain.driver import _progress, _show

from test_driver import problem

pytest.importorskip("tqdm")


def _screen(text: str) -> list[str]:
    """The lines as a terminal leaves them (a carriage return starts the line over)."""
    lines = []
    for raw in text.split("\n"):
        line = ""
        for part in raw.split("\r"):
            line = part + line[len(part):]
        lines.append(line.rstrip())
    return lines


def test_no_eta_while_a_compile_is_pending_and_every_label_has_its_rate(capsys):
    progress, rates = Progress(), PhaseRates()
    runner = types.SimpleNamespace(progress=progress, rates=rates)
    bar = _progress(100, 0, phases=True)
    shown = [0.0, None]
    rates.record("eager", False)
    rates.record("eager", False)
    bar.update(2)
    _show(bar, runner, shown)  # nothing compiles (not started, or declined): the eager path is the one that runs
    assert bar.desc.startswith("eager ") and " it/s · ETA " in bar.desc, bar.desc
    progress, rates = Progress(), PhaseRates()
    runner = types.SimpleNamespace(progress=progress, rates=rates)
    shown = [0.0, None]
    progress.phase = "compiling"
    rates.record("eager", False)
    _show(bar, runner, shown, final=False)
    assert bar.desc == "compiling in the background · eager ? it/s"  # a label with its rate, not measured yet
    for _ in range(4):
        rates.record("eager", False)
        bar.update(1)
    shown[0] = 0.0
    _show(bar, runner, shown)
    line = str(bar)
    assert "compiling in the background · eager " in line and " it/s" in line
    assert "ETA" not in line and "<" not in line  # the compiled rate, which decides the rest, is unknown
    progress.phase = "compiled"
    for _ in range(4):
        rates.record("compiled", False)
        bar.update(1)
    shown[0] = 0.0
    _show(bar, runner, shown)
    line = str(bar)
    assert "compiled " in line and "(eager " in line and " · ETA " in line  # from the compiled rate
    _show(bar, runner, shown, final=True)
    assert "ETA" not in bar.desc and bar.desc.startswith("compiled ") and bar.desc.count("it/s") == 2
    bar.close()


def test_a_line_logged_during_the_run_goes_above_the_bar_and_the_streams_come_back(capsys):
    step, state, data = problem()
    handler = logging.StreamHandler(sys.stderr)  # bound to the stream the bar draws on
    root = logging.getLogger()
    root.addHandler(handler)
    old_level = root.level
    root.setLevel(logging.INFO)
    stdout, stderr = sys.stdout, sys.stderr
    try:
        def on_step(i, s, m):
            if i == 1:
                logging.getLogger("functrain.test").info("a log line")
                print("a printed line")

        ft.run(step, state, data, num_steps=3, on_step=on_step)
        err = capsys.readouterr().err
        assert "a log line" in _screen(err), _screen(err)  # on its own line, not glued onto the bar
        assert sys.stdout is stdout and sys.stderr is stderr and handler.stream is stderr

        def boom(i, s, m):
            raise ZeroDivisionError("in on_step")

        with pytest.raises(ZeroDivisionError):
            ft.run(step, state, data, num_steps=3, on_step=boom)
        assert sys.stdout is stdout and sys.stderr is stderr and handler.stream is stderr
    finally:
        root.removeHandler(handler)
        root.setLevel(old_level)
