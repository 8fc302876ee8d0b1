"""``ft.benchmark`` and ``python -m functrain.bench``: the report's fields, its paired-ratio math, host syncs,
recompile reasons, the command, and bad arguments named. The aot_eager backend keeps the compiles short; nothing
here asserts that one variant is faster than another."""
from __future__ import annotations

import json
import os
import re
import statistics
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

import functrain as ft
from functrain.bench import VARIANTS, Report, signature_changes
from functrain.bench.__main__ import main
from functrain.bench.report import PHASES, WIDTH
from functrain.bench.stats import bootstrap_ci, paired_ratios, spread
from conftest import CountHostPulls

FAST = {"backend": "aot_eager"}


def tiny(sync: bool = False):
    """An MLP 4-16-1 with AdamW; ``sync``: its loss reads a value to the host once per call (a planted sync)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    apply_fn, params, buffers = ft.functionalize(model)

    def loss_fn(p, b, batch):
        x, y = batch
        loss = torch.nn.functional.mse_loss(apply_fn(p, b, x), y)
        if sync and loss.item() < 0:  # never true: only the read matters
            loss = -loss
        return loss

    step = ft.train_step(loss_fn, ft.optim.adamw(1e-3))
    return step, step.init(params, buffers, seed=0), (torch.randn(8, 4), torch.randn(8, 1))


def test_the_report_has_every_field_and_leaves_the_state_alone(capfd):
    step, state, batch = tiny()
    before = {k: v.clone() for k, v in state.params.items()}
    capfd.readouterr()
    report = ft.benchmark(step, state, batch, steps=2, warmup=1, rounds=3, compile_kwargs=FAST)
    # the profiler behind the measured memory printed its stages on stderr at every start and stop (six lines for
    # three variants); they are not the user's business, and nothing else it wrote is lost (see the next test)
    err = capfd.readouterr().err
    assert "profiler_start" not in err and "profiler_stop" not in err and "SyncActivityProfilerHandler" not in err, err
    assert isinstance(report, Report) and list(report.variants) == list(VARIANTS)
    for k, v in before.items():  # the donating variant stepped a copy
        assert torch.equal(state.params[k], v)
    for name, v in report.variants.items():
        assert v.call == VARIANTS[name]
        assert len(v.round_s) == 3 and all(t > 0 for t in v.round_s)
        assert set(v.time) == {"median", "min", "max", "q1", "q3"}
        assert v.first_call_s > 0
        assert v.syncs_per_step == 0 and v.syncs_by_op == {}
        assert v.memory_measured is not None and v.memory_measured >= 0
        assert v.recompiles == [] and v.recompiles_in_rounds == 0
        if name == "eager":
            assert v.ratio is None and v.compile is None and v.graphs is None and v.memory_estimated is None
            continue
        assert v.graphs == 1  # each its own graph: the donating call is not the plain call's
        assert set(v.compile["phases"]) == set(PHASES) and v.compile["phases"]["trace"] > 0
        assert v.compile["total"] >= sum(x for x in v.compile["phases"].values()) - 1e-9
        est = v.memory_estimated
        assert est["allocated"] == est["step_peak"] + est["new_state"] > 0 and est["total"] > est["allocated"]
        assert "memory per rank" in est["text"] and (est["new_state"] == 0) == (name == "donating")
        assert len(v.ratio["per_round"]) == 3 and {"median", "q1", "q3", "min", "max", "ci95"} <= set(v.ratio)
        assert v.warm_compile is None  # (cold=False)
    data = json.loads(report.to_json())
    assert data["variants"]["donating"]["call"] == "cstep.runner(donate=True)"
    assert data["meta"]["backend"] == "aot_eager" and data["meta"]["rounds"] == 3 and data["meta"]["steps"] == 2
    text = str(report)
    for name in VARIANTS:
        assert f"| {name} | " in text and f"{name} `{VARIANTS[name]}`" in text  # its row, and the call it timed
    assert all(len(line) <= WIDTH for line in text.splitlines()), max(text.splitlines(), key=len)
    meta = data["meta"]
    assert meta["cores"] >= 1 and meta["load_before"] >= 0 and meta["load_after"] >= 0 and meta["cpu_share"] > 0
    assert f"the 1-minute load average was {meta['load_before']:.1f} at the start and {meta['load_after']:.1f}" in text


def test_only_the_profilers_stage_lines_are_taken_out_of_stderr(capfd):
    """What else is written to file descriptor 2 while the memory is measured (a C++ warning, Python's stderr)
    comes out, in order; only kineto's USDT/STAGE lines are dropped."""
    from functrain.bench.timing import _without_profiler_lines

    capfd.readouterr()
    with _without_profiler_lines():
        os.write(2, b"USDT:2026-12-06 22:11:12 24348:24348 SyncActivityProfilerHandler.cpp:52] profiler_start\n")
        os.write(2, b"[W kineto] a real warning\n")
        sys.stderr.write("python's own line\n")
        os.write(2, b"STAGE:2026-12-06 22:12:18 25746:25746 SyncActivityProfilerHandler.cpp:60] Completed Stage\n")
    out = capfd.readouterr()
    # (under pytest's capture Python's sys.stderr bypasses descriptor 2, so only the set of lines is compared)
    assert sorted(out.err.splitlines()) == ["[W kineto] a real warning", "python's own line"], out.err


def _busy_meta(**changes):
    meta = {"rounds": 10, "steps": 50, "warmup": 2, "batches": 1, "device": "cpu", "threads": 1,
            "torch": "2.13.0+cpu", "backend": "inductor", "path": "direct", "cache": "cold (an empty cache_dir), "
            "then warm", "cores": 2, "load_before": 9.7, "load_after": 9.9, "cpu_share": 0.41}
    return {**meta, **changes}


def test_the_table_fits_120_columns_and_says_when_the_machine_was_loaded():
    """The table wrapped at 120 columns (one row of eight columns) and said nothing of the machine's load. Now two
    tables and lines of at most 120 characters, with long numbers in every cell, and a line that says LOADED when
    the load average passed the cores or the process had the CPU for less than 80% of the rounds."""
    from functrain.bench import VariantResult

    def variant(name, ratio):
        t = {"median": 123.45e-3, "q1": 123.45e-3, "q3": 999.99e-3, "min": 100.01e-3, "max": 999.99e-3}
        compile_ = {"total": 1234.56, "phases": dict.fromkeys(PHASES, 123.45),
                    "cache": {"fxgraph_miss": 12, "aot_miss": 12, "fxgraph_hit": 3}}
        return VariantResult(name=name, call=VARIANTS[name], time=t, graphs=12, syncs_per_step=12.5,
                             ratio=None if ratio is None else {"median": ratio, "q1": ratio, "q3": ratio, "min": ratio,
                                                               "max": ratio},
                             compile=None if ratio is None else compile_, warm_compile=compile_,
                             memory_estimated=None if ratio is None else {"allocated": 1023 << 30},
                             memory_measured=1023 << 30,
                             recompiles=[{"reason": "batch[0]: shape (8, 4) -> (5, 4); " * 5, "changes": []}])

    report = Report(meta=_busy_meta(), variants={"eager": variant("eager", None),
                                                 "compiled": variant("compiled", 123.45),
                                                 "donating": variant("donating", 10.57)},
                    notes=["a long note " * 30])
    text = str(report)
    assert all(len(line) <= WIDTH for line in text.splitlines()), max(text.splitlines(), key=len)
    machine = " ".join(ln.strip() for ln in text.split("\n\n")[0].splitlines()[2:])
    assert machine.startswith("machine: LOADED: the 1-minute load average was 9.7 at the start and 9.9 at the end, "
                              "on 2 cores; this process used the CPU for 41% of the timed rounds' wall time"), machine
    quiet = str(Report(meta=_busy_meta(load_before=0.4, load_after=0.6, cpu_share=0.99), variants={}))
    assert "machine: the 1-minute load average was 0.4 at the start and 0.6 at the end, on 2 cores" in quiet
    assert "LOADED" not in quiet
    starved = str(Report(meta=_busy_meta(load_before=1.0, load_after=1.2, cpu_share=0.5), variants={}))
    assert "machine: LOADED:" in starved  # the load average lags; the process's own CPU share does not


def test_the_paired_ratios_are_per_round_then_summarised():
    step, state, batch = tiny()
    report = ft.benchmark(step, state, batch, steps=1, warmup=0, rounds=5, variants=["compiled", "eager"],
                          compile_kwargs=FAST, memory=False)
    eager, compiled = report["eager"].round_s, report["compiled"].round_s
    ratios = [c / e for c, e in zip(compiled, eager)]  # the reference, computed here
    r = report["compiled"].ratio
    assert r["per_round"] == pytest.approx(ratios, rel=1e-12)
    assert r["median"] == pytest.approx(statistics.median(ratios), rel=1e-12)
    assert (r["min"], r["max"]) == pytest.approx((min(ratios), max(ratios)), rel=1e-12)
    assert (r["q1"], r["q3"]) == pytest.approx(tuple(np.percentile(ratios, [25, 75])), rel=1e-12)
    assert r["ci95"][0] <= r["median"] <= r["ci95"][1]
    t = report["eager"].time
    assert (t["median"], t["q1"], t["q3"]) == pytest.approx((statistics.median(eager),
                                                             *np.percentile(eager, [25, 75])), rel=1e-12)
    assert report["compiled"].memory_estimated is None and report["compiled"].memory_measured is None


def test_stats_on_fixed_numbers():
    assert paired_ratios([2.0, 3.0], [1.0, 4.0]) == [2.0, 0.75]
    assert spread([4.0, 1.0, 3.0, 2.0]) == {"median": 2.5, "min": 1.0, "max": 4.0, "q1": 1.75, "q3": 3.25}
    assert spread([7.0]) == {"median": 7.0, "min": 7.0, "max": 7.0, "q1": 7.0, "q3": 7.0}
    assert bootstrap_ci([5.0]) == (5.0, 5.0)
    with pytest.raises(ValueError, match="3 rounds against 2"):
        paired_ratios([1.0, 2.0, 3.0], [1.0, 2.0])


def test_a_planted_host_sync_counts_once_per_step():
    step, state, batch = tiny(sync=True)
    report = ft.benchmark(step, state, batch, steps=1, warmup=0, rounds=1, variants=["eager"], memory=False)
    assert report["eager"].syncs_per_step == 1
    assert report["eager"].syncs_by_op == {"_local_scalar_dense": 1.0}
    with CountHostPulls() as pulls:  # the tests' own counter agrees
        step(state, batch)
    assert pulls.pulls == 1


def test_a_new_batch_shape_records_what_changed():
    step, state, batch = tiny()
    short = (torch.randn(5, 4), torch.randn(5, 1))
    report = ft.benchmark(step, state, batch, steps=2, warmup=0, rounds=2, batches=[short],
                          variants=["compiled", "donating"], compile_kwargs=FAST, memory=False)
    for name in ("compiled", "donating"):
        v = report[name]
        assert v.graphs == 2 and v.recompiles_in_rounds == 0  # the warm-up compiled both signatures
        (again,) = v.recompiles
        assert again["changes"] == [
            {"leaf": "batch[0]", "what": "shape", "old": [8, 4], "new": [5, 4]},
            {"leaf": "batch[1]", "what": "shape", "old": [8, 1], "new": [5, 1]}]
        assert again["reason"] == "batch[0]: shape (8, 4) -> (5, 4); batch[1]: shape (8, 1) -> (5, 1)"
    assert "recompile of compiled: batch[0]: shape (8, 4) -> (5, 4)" in str(report)


def test_the_runner_records_each_recapture_and_what_changed():
    step = ft.train_step(lambda p, b, batch: (p["w"] * batch["x"]).sum() * batch["k"], ft.optim.sgd(0.1))
    run = ft.compile(step, **FAST).runner()
    state = step.init({"w": torch.ones(3)})
    state, _ = run(state, {"x": torch.ones(2, 3), "k": 2})
    state, _ = run(state, {"x": torch.ones(2, 3), "k": 2})
    assert run.recaptures == []  # the same signature: no capture
    state, _ = run(state, {"x": torch.ones(2, 3, dtype=torch.float64), "k": 2})
    state, _ = run(state, {"x": torch.ones(2, 3), "k": 3})
    state, _ = run(state, {"x": torch.ones(2, 3), "k": 3, "extra": torch.ones(1)})
    state, _ = run(state, {"x": torch.ones(3, 2).t(), "k": 3})
    changes = [signature_changes(old, new) for old, new in run.recaptures]
    assert changes[0] == [{"leaf": "batch['x']", "what": "dtype", "old": "torch.float32", "new": "torch.float64"}]
    assert changes[1] == [{"leaf": "batch['k']", "what": "value", "old": "2", "new": "3"},  # (leaves in key order)
                          {"leaf": "batch['x']", "what": "dtype", "old": "torch.float64", "new": "torch.float32"}]
    assert [(c["leaf"], c["what"]) for c in changes[2]] == [("batch", "structure")]
    assert "'extra'" in changes[2][0]["new"] and "'extra'" not in changes[2][0]["old"]
    assert [(c["leaf"], c["what"]) for c in changes[3]] == [("batch", "structure")]  # (the key went away again)
    assert len(run.recaptures) == 4


def test_a_stride_change_alone_is_named():
    step = ft.train_step(lambda p, b, x: (p["w"] * x).sum(), ft.optim.sgd(0.1))
    run = ft.compile(step, **FAST).runner()
    state = step.init({"w": torch.ones(3, 3)})
    state, _ = run(state, torch.ones(3, 3))
    state, _ = run(state, torch.ones(3, 3).t().contiguous().t())  # same shape, transposed strides
    (changes,) = [signature_changes(o, n) for o, n in run.recaptures]
    assert changes == [{"leaf": "batch", "what": "stride", "old": [3, 1], "new": [1, 3]}]


def test_a_compiled_step_is_compiled_afresh_and_waited_for():
    step, state, batch = tiny()
    cstep = ft.compile(step, backend="aot_eager", background=True)
    report = ft.benchmark(cstep, state, batch, steps=1, warmup=0, rounds=1, variants=["compiled"], memory=False)
    assert report["compiled"].graphs == 1 and report["compiled"].compile is not None
    assert cstep.compiles == 0  # (the given step's own graphs were not touched)


def test_a_donating_step_serves_both_compiled_variants_with_one_graph():
    step, state, batch = tiny()
    report = ft.benchmark(ft.compile(step, backend="aot_eager", donate=True), state, batch, steps=1, warmup=0,
                          rounds=1, variants=["compiled", "donating"], memory=False)
    assert report["compiled"].graphs == 1 and report["donating"].graphs == 0
    assert report["donating"].compile is None and any(n.startswith("donating: its first call compiled nothing")
                                                      for n in report.notes)


def test_the_dynamo_path_is_timed_without_a_trace_apart_or_a_sync_count():
    step, state, batch = tiny()
    report = ft.benchmark(step, state, batch, steps=1, warmup=0, rounds=2, variants=["eager", "compiled"],
                          compile_kwargs={"backend": "aot_eager", "capture": "dynamo"}, memory=False)
    v = report["compiled"]
    assert report.meta["path"] == "dynamo" and v.graphs == 1 and v.compile["phases"]["trace"] is None
    assert v.syncs_per_step is None and len(v.ratio["per_round"]) == 2


@pytest.mark.parametrize("kwargs, error, match", [
    ({"steps": 0}, ValueError, r"ft.benchmark: steps must be an int >= 1; got 0"),
    ({"rounds": 1.5}, ValueError, r"ft.benchmark: rounds must be an int >= 1; got 1.5"),
    ({"warmup": -1}, ValueError, r"ft.benchmark: warmup must be an int >= 0; got -1"),
    ({"variants": ["eager", "jit"]}, ValueError, r"variants must be distinct names from \['eager', 'compiled', "
                                                 r"'donating'\]; got \['eager', 'jit'\]"),
    ({"variants": ["eager", "eager"]}, ValueError, r"distinct names"),
    ({"variants": "eager"}, ValueError, r"variants must be a non-empty list"),
    ({"variants": []}, ValueError, r"variants must be a non-empty list"),
    ({"batches": 3}, TypeError, r"batches must be a list of more batches; got 3 \(int\)"),
    ({"compile_kwargs": "aot_eager"}, TypeError, r"compile_kwargs must be a dict"),
    ({"compile_kwargs": {"background": True}}, ValueError, r"compile_kwargs\['background'\]=True"),
    ({"cold": True, "compile_kwargs": {"cache_dir": "x"}}, ValueError, r"drop compile_kwargs\['cache_dir'\]"),
    ({"cold": 1}, TypeError, r"cold must be True, False or an empty folder; got 1"),
    ({"cold": __file__}, ValueError, r"cold='.*test_benchmark.py' must be an empty folder"),
    ({"memory": None}, TypeError, r"memory must be True or False; got None"),
])
def test_bad_arguments_are_named(kwargs, error, match):
    step, state, batch = tiny()
    with pytest.raises(error, match=match):
        ft.benchmark(step, state, batch, **kwargs)


def test_cold_in_a_process_that_compiled_already_says_so():
    step, state, batch = tiny()
    ft.compile(step, **FAST)  # (fixes this process's inductor cache folder, if nothing did before)
    with pytest.warns(UserWarning, match="already compiles into"), \
            pytest.raises(RuntimeError, match=r"cold=True.*process-wide.*python -m functrain.bench module:make_step "
                                              r"--cold"):
        ft.benchmark(step, state, batch, cold=True, compile_kwargs=FAST)


def test_bad_step_state_and_compile_kwargs_are_named():
    step, state, batch = tiny()
    with pytest.raises(TypeError, match=r"takes a functrain Step .*; got a Sequential$"):
        ft.benchmark(torch.nn.Sequential(), state, batch)
    with pytest.raises(TypeError, match=r"takes the TrainState to start from .*; got a dict$"):
        ft.benchmark(step, dict(state.params), batch)
    with pytest.raises(TypeError, match=r"compile_kwargs are for a plain Step"):
        ft.benchmark(ft.compile(step), state, batch, compile_kwargs=FAST)


MODULE = """
import torch
import functrain as ft

def make_step():
    model = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    apply_fn, params, buffers = ft.functionalize(model)
    loss_fn = lambda p, b, batch: torch.nn.functional.mse_loss(apply_fn(p, b, batch[0]), batch[1])
    step = ft.train_step(loss_fn, ft.optim.adamw(1e-3))
    return step, step.init(params, buffers), (torch.randn(8, 4), torch.randn(8, 1))

def two():
    return 1, 2

def not_a_step():
    return 1, 2, 3
"""


def test_the_command_prints_the_report_and_its_json(tmp_path):
    (tmp_path / "mystep.py").write_text(textwrap.dedent(MODULE))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    base = [sys.executable, "-m", "functrain.bench", "mystep:make_step", "--steps", "2", "--rounds", "2",
            "--warmup", "1", "--backend", "aot_eager"]
    done = subprocess.run(base + ["--json", "--cold"], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    data = json.loads(done.stdout)
    assert list(data["variants"]) == list(VARIANTS)
    assert data["meta"]["backend"] == "aot_eager" and data["meta"]["steps"] == 2
    for name in ("compiled", "donating"):
        v = data["variants"][name]
        assert v["compile"] is not None and v["warm_compile"] is not None and len(v["ratio"]["per_round"]) == 2
    assert data["meta"]["cold_dir"] and not os.path.exists(data["meta"]["cold_dir"])  # removed at the end
    done = subprocess.run(base[:3] + [str(tmp_path / "mystep.py") + ":make_step", "--variants", "eager",
                                      "--steps", "1", "--rounds", "1", "--no-memory"],
                          cwd=tmp_path.parent, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "\n| eager | " in done.stdout and "calls: eager `step(state, batch)`" in done.stdout
    assert done.stdout.startswith("ft.benchmark: 1 rounds")
    assert "compile s =" not in done.stdout  # (no compile and no memory: no second table)


@pytest.mark.parametrize("argv, match", [
    (["nocolon"], "target 'nocolon' must be module:function"),
    (["no_such_module_xyz:make_step"], "no module named 'no_such_module_xyz'"),
    (["missing.py:make_step"], "no file 'missing.py'"),
    (["benchmod:nothing"], "module 'benchmod' has no function 'nothing'"),
    (["benchmod:two"], r"benchmod:two\(\) must return \(step, state, batch\); it returned tuple of 2"),
    (["benchmod:not_a_step"], "with step a functrain Step or CompiledStep; its first item is a int"),
    (["benchmod:make_step", "--variants", "eager,jit"], "--variants 'eager,jit': each must be one of "
                                                        "eager,compiled,donating"),
])
def test_the_command_names_a_bad_target(argv, match, tmp_path, monkeypatch, capsys):
    (tmp_path / "benchmod.py").write_text(textwrap.dedent(MODULE))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.delitem(sys.modules, "benchmod", raising=False)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("python -m functrain.bench: ") and re.search(match, err), err


@pytest.mark.parametrize("flag, value", [("--steps", "0"), ("--rounds", "x"), ("--warmup", "-1")])
def test_the_command_refuses_bad_numbers(flag, value, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["m:f", flag, value])
    assert exit_.value.code == 2
    assert f"argument {flag}" in capsys.readouterr().err
