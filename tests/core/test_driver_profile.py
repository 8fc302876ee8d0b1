"""ft.run(profile=): a Chrome trace of the requested steps with each step's range (and phase) and the stages of an
eager step, a printed table of the time per stage, and the same state as an unprofiled run, bit for bit."""
import json

import pytest

import functrain as ft
from functrain import tree as T
from functrain.compiler.profiling import Profile
from functrain.core.step import STAGES

from test_driver import problem


@pytest.fixture(scope="module")
def profiled(tmp_path_factory):
    step, state, data = problem()
    path = tmp_path_factory.mktemp("profile") / "trace.json"
    return step, state, data, path, ft.run(step, state, data, num_steps=6, progress=False,
                                           profile=Profile(path, steps=3, skip=1))


def test_the_trace_holds_the_profiled_steps_and_every_stage(profiled):
    *_, path, _ = profiled
    trace = json.loads(path.read_text())  # valid JSON
    names = {e.get("name") for e in trace["traceEvents"]}
    steps = sorted(n for n in names if n and n.startswith("functrain/step "))
    assert steps == [f"functrain/step {i} (eager)" for i in (2, 3, 4)]  # after skip=1, three steps
    assert {f"functrain/stage/{s}" for s in STAGES} <= names


def test_the_table_lists_the_stages(profiled, capsys):
    step, state, data, path, _ = profiled
    ft.run(step, state, data, num_steps=2, progress=False, profile=str(path))
    out = capsys.readouterr().out
    assert f"profile of steps 1-2 (trace: {path})" in out
    rows = [line.split()[0] for line in out.splitlines() if line.startswith("  ")]
    assert [r for r in rows if r in STAGES] == list(STAGES)
    assert "eager" in rows  # the phase rows


def test_profiling_does_not_change_the_state(profiled):
    step, state, data, _, got = profiled
    plain = ft.run(step, state, data, num_steps=6, progress=False)
    assert T.tree_equal(got, plain) and int(got.step) == 6


def test_bad_profile_requests_are_named(tmp_path):
    step, state, data = problem()
    with pytest.raises(TypeError, match="profile must be None, a trace file path or .*Profile; got int 3"):
        ft.run(step, state, data, progress=False, profile=3)
    with pytest.raises(ValueError, match="steps must be an int >= 1; got 0"):
        Profile(tmp_path / "t.json", steps=0)
    with pytest.raises(ValueError, match="does not exist"):
        Profile(tmp_path / "missing" / "t.json")
    with pytest.raises(ValueError, match="is a folder"):
        Profile(tmp_path)


def test_a_compiled_step_s_profile_has_its_step_ranges_and_no_stages(tmp_path):
    step, state, data = problem()
    path = tmp_path / "compiled.json"
    cstep = ft.compile(step, backend="aot_eager", background=False)
    got = ft.run(cstep, state, data, num_steps=4, progress=False, donate=False, profile=Profile(path, steps=2, skip=1))
    names = {e.get("name") for e in json.loads(path.read_text())["traceEvents"]}
    assert sorted(n for n in names if n and n.startswith("functrain/")) == [
        "functrain/step 2 (compiled)", "functrain/step 3 (compiled)"]  # one graph: no stage ranges in it
    assert T.tree_equal(got, ft.run(cstep, state, data, num_steps=4, progress=False, donate=False))
