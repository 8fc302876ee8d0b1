"""The compile policy (functrain.compiler.policy), the machine's compile history (functrain.compiler.history),
nothing of a run outliving it, and compiling ahead (CompiledStep.precompile)."""
from __future__ import annotations

import json
import math
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import time
import warnings

import pytest
from hypothesis import given
from hypothesis import strategies as st

from functrain.compiler import history as history_mod
from functrain.compiler.history import History
from functrain.compiler.policy import FORCES, VOTE_SIZE, Inputs, combine, decide, from_vote, vote
from functrain.compiler.settings import BadSetting, WorkerSettings

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
JOB = os.path.join(HERE, "policy_job.py")


# -- the decision, a pure function ----------------------------------------------------------------
def _reference(i: Inputs) -> tuple[bool, float, float]:
    """The model of the module docstring, written out again: (spare, gain, cost)."""
    occupied = max(i.busy, i.load)
    spare = i.cores - occupied >= 1
    ready = i.compile_cpu_s if spare else i.compile_cpu_s * (occupied + 1) / i.cores
    cost = i.load_s if spare else i.compile_cpu_s + i.load_s
    steps_while = ready / i.eager_s if i.eager_s > 0 else math.inf
    gain = max(0.0, i.remaining - steps_while) * i.eager_s * max(0.0, 1 - i.compiled_ratio)
    return spare, gain, cost


README = Inputs(remaining=400, eager_s=0.005, compile_cpu_s=60.0, compiled_ratio=0.8, cores=2, busy=2)


@pytest.mark.parametrize("inputs, compiles, spare", [
    (README, False, False),  # the README's main job on a 2-core machine: 2 s of steps, a minute of compile
    (README._replace(remaining=1_000_000), True, False),  # a long run pays for it even on the ranks' cores
    (README._replace(cores=16), False, True),  # a spare core, but the run ends long before the compile
    (README._replace(cores=16, remaining=100_000), True, True),
    (README._replace(cores=16, remaining=100_000, load=15.5), True, False),  # others keep the cores busy
    (README._replace(remaining=None), True, False),  # an unknown length compiles (as before)
    (README._replace(remaining=10**9, compiled_ratio=1.2), False, False),  # compiled no faster: never pays
    (README._replace(remaining=0, force="always"), True, False),
    (README._replace(remaining=10**9, cores=64, force="never"), False, True),
])
def test_decision_table(inputs, compiles, spare):
    d = decide(inputs)
    assert (d.compile, d.spare) == (compiles, spare), d
    assert d.inputs == inputs and d.record()["compile"] == compiles


def test_a_decline_says_the_numbers_and_how_to_compile_ahead():
    d = decide(README)
    assert d.why.startswith("compiling would not pay in this run: ~60 s to compile, ~0 s to gain"), d.why
    assert "precompile" in d.why and "--precompile" in d.why


@pytest.mark.parametrize("field, value, allowed", [
    ("remaining", -1, "an int >= 0 or None"), ("remaining", 1.5, "an int >= 0 or None"),
    ("eager_s", float("nan"), "a finite number >= 0"), ("compile_cpu_s", -2.0, "a finite number >= 0"),
    ("compiled_ratio", 0.0, "a finite number > 0"), ("cores", 0, "an int >= 1"), ("busy", True, "an int >= 1"),
    ("load", float("inf"), "a finite number >= 0"), ("force", "sometimes", "one of 'auto', 'always', 'never'"),
])
def test_bad_inputs_are_named(field, value, allowed):
    with pytest.raises(ValueError, match=f"{field} must be {allowed}; got {value!r}"):
        decide(README._replace(**{field: value}))


inputs = st.builds(
    Inputs, remaining=st.integers(0, 10**7), eager_s=st.floats(1e-5, 10.0), compile_cpu_s=st.floats(0.0, 3600.0),
    compiled_ratio=st.floats(0.05, 2.0), cores=st.integers(1, 128), busy=st.integers(1, 16),
    load=st.floats(0.0, 64.0), force=st.just("auto"), load_s=st.floats(0.0, 10.0))


@given(inputs, st.integers(0, 10**7))
def test_monotone_in_the_steps_left(i, more):
    if decide(i).compile:
        assert decide(i._replace(remaining=i.remaining + more)).compile


@given(inputs, st.integers(0, 64))
def test_more_cores_never_turn_a_compile_into_a_decline(i, more):
    if decide(i).compile:
        assert decide(i._replace(cores=i.cores + more)).compile


@given(inputs)
def test_compiles_exactly_when_the_gain_exceeds_the_cost(i):
    spare, gain, cost = _reference(i)
    d = decide(i)
    assert d.spare == spare
    assert d.compile == (gain > cost)
    if not spare:  # no spare core: never when the gain is below the compile's cost
        assert cost >= i.compile_cpu_s
        if gain <= i.compile_cpu_s:
            assert not d.compile


@given(st.lists(st.builds(Inputs, remaining=st.one_of(st.none(), st.integers(0, 10**7)),
                          eager_s=st.floats(0.0, 10.0), compile_cpu_s=st.floats(0.0, 3600.0),
                          compiled_ratio=st.floats(0.05, 2.0), cores=st.integers(1, 128), busy=st.integers(1, 16),
                          load=st.floats(0.0, 64.0), force=st.sampled_from(FORCES), load_s=st.floats(0.0, 10.0),
                          source=st.sampled_from(["default", "history"])), min_size=1, max_size=5), st.randoms())
def test_the_least_of_the_ranks_votes_is_their_combined_inputs(ranks, rnd):
    """A law: the elementwise least of the ranks' votes (what the per-call MIN all-reduce makes), in any order,
    stands for the combined inputs, written out again here: the fewest steps left (unknown if any is), the
    slowest step, the dearest compile, the fewest cores, the most ranks and load, the strongest force."""
    order = list(ranks)
    rnd.shuffle(order)
    least = tuple(min(v) for v in zip(*(vote(i) for i in order)))
    left = [i.remaining for i in ranks]
    want = Inputs(remaining=None if None in left else min(left), eager_s=max(i.eager_s for i in ranks),
                  compile_cpu_s=max(i.compile_cpu_s for i in ranks),
                  compiled_ratio=max(i.compiled_ratio for i in ranks), cores=min(i.cores for i in ranks),
                  busy=max(i.busy for i in ranks), load=max(i.load for i in ranks),
                  force="never" if any(i.force == "never" for i in ranks) else
                  "always" if any(i.force == "always" for i in ranks) else "auto",
                  load_s=max(i.load_s for i in ranks),
                  source="history" if all(i.source == "history" for i in ranks) else "default")
    assert from_vote(least) == want == combine(order)
    assert decide(from_vote(least)) == decide(want)  # every rank decides the same
    assert from_vote(tuple(min(a, b) for a, b in zip(least, (math.inf,) * VOTE_SIZE))) == want  # a rank with none


def test_a_vote_without_numbers_or_of_another_length_is_refused():
    with pytest.raises(ValueError, match="a vote is 10 finite numbers"):
        from_vote((math.inf,) * VOTE_SIZE)
    with pytest.raises(ValueError, match="a vote is 10 finite numbers"):
        from_vote(vote(README)[:-1])
    with pytest.raises(ValueError, match="no inputs"):
        combine([])
    with pytest.raises(ValueError, match="source must be one of 'default', 'history'; got 'guess'"):
        vote(README._replace(source="guess"))


@given(inputs, st.sampled_from(["always", "never"]))
def test_forcing_wins(i, force):
    assert decide(i._replace(force=force)).compile == (force == "always")


@given(inputs)
def test_an_unknown_length_compiles(i):
    assert decide(i._replace(remaining=None)).compile


def test_the_setting_forces_and_finish_is_opt_in():
    assert WorkerSettings.from_env({}).policy == "auto"
    assert WorkerSettings.from_env({}).finish is False  # nothing of a run outlives it unless asked
    assert WorkerSettings.from_env({"FUNCTRAIN_COMPILE_POLICY": "never"}).policy == "never"
    with pytest.raises(BadSetting, match="FUNCTRAIN_COMPILE_POLICY must be 'auto' .* got 'sometimes'"):
        WorkerSettings.from_env({"FUNCTRAIN_COMPILE_POLICY": "sometimes"})


# -- the history file -------------------------------------------------------------------------------
def test_history_predicts_from_what_it_recorded(tmp_path):
    path = str(tmp_path / "h.json")
    h = History(path)
    assert h.predict("cpu:default", 100) == (history_mod.DEFAULT_BASE_S + history_mod.DEFAULT_PER_NODE_S * 100,
                                             history_mod.DEFAULT_RATIO, "default")
    h.add_compile("cpu:default", 1000, 30.0)
    h.add_compile("cpu:default", 100, 2.0)
    for e, c in ((1.0, 0.5), (1.0, 0.7), (2.0, 0.4)):
        h.add_steps("cpu:default", e, c)
    again = History(path)  # written, and read back
    p = again.predict("cpu:default", 200)  # the nearest size (100 nodes: 2 s), scaled by the node ratio
    assert p.source == "history" and p.compile_cpu_s == pytest.approx(4.0) and p.compiled_ratio == 0.5
    assert again.predict("cuda:default", 200).source == "default"  # another kind: the defaults
    for _ in range(history_mod.KEEP + 5):
        again.add_compile("cpu:default", 10, 1.0)
    assert len(History(path).data["kinds"]["cpu:default"]["compiles"]) == history_mod.KEEP


def test_a_history_write_is_atomic(tmp_path, monkeypatch):
    path = str(tmp_path / "h.json")
    h = History(path)
    h.add_compile("cpu:default", 100, 5.0)
    before = open(path).read()

    def torn(data, f, **kw):  # the write dies half-way
        f.write('{"format": 1, "kin')
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(history_mod.json, "dump", torn)
    with pytest.warns(RuntimeWarning, match="was not written"):
        h.add_compile("cpu:default", 200, 9.0)
    assert open(path).read() == before  # the old file whole
    assert sorted(os.listdir(tmp_path)) == ["h.json"]  # no temporary file left


@pytest.mark.parametrize("content, why", [
    (b"{not json", "it is not JSON"),
    (b'{"format": 1, "kinds": {"cpu:default": {"compiles": [{"nodes": "x", "cpu_s": 1}]}}}',
     "it is not a format-1 compile history"),
    (b'[1, 2, 3]', "it is not a format-1 compile history"),
    (b" " * (history_mod.MAX_BYTES + 1), "it is larger than"),
])
def test_a_damaged_history_is_set_aside_with_a_warning(tmp_path, content, why):
    path = tmp_path / "h.json"
    path.write_bytes(content)
    with pytest.warns(RuntimeWarning, match=f"not using the compile history .*: {why}"):
        h = History(str(path))
    assert h.predict("cpu:default", 10).source == "default"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        h.add_compile("cpu:default", 10, 1.0)
    assert (tmp_path / "h.json.damaged").read_bytes() == content  # kept, not lost
    assert History(str(path)).predict("cpu:default", 10).source == "history"


def test_a_history_behind_a_link_is_not_read(tmp_path):
    target = tmp_path / "elsewhere.json"
    target.write_text(json.dumps({"format": 1, "kinds": {}}))
    (tmp_path / "h.json").symlink_to(target)
    with pytest.warns(RuntimeWarning, match="cannot be opened"):
        h = History(str(tmp_path / "h.json"))
    assert h.data == {"format": 1, "kinds": {}}


def _steps(eager_s, compiled_s):
    return json.dumps({"format": 1, "kinds": {"cpu:default": {"compiles": [{"nodes": 100, "cpu_s": 30.0}],
                                                               "steps": [{"eager_s": eager_s, "compiled_s": compiled_s}]}}})


def _judged(h: History) -> None:
    """What the runner does with a history: a prediction, then the policy's decision (which checks its inputs)."""
    for nodes in (0, 1, 10**6, 10**12):
        p = h.predict("cpu:default", nodes)
        assert all(math.isfinite(v) and v > 0 for v in p[:2]), p
        assert history_mod.RATIO[0] <= p.compiled_ratio <= history_mod.RATIO[1], p
        decide(README._replace(compile_cpu_s=p.compile_cpu_s, compiled_ratio=p.compiled_ratio, source=p.source))
    assert h.untraced("cpu:default") is None or math.isfinite(h.untraced("cpu:default").compiled_ratio)


def _plant_fifo(path):
    os.mkfifo(path)
    return True


HOSTILE = {  # what is planted at the history's path -> the warning's reason
    "deep": (lambda p: p.write_bytes(b"[" * 200_000), r"it is not JSON \(RecursionError"),
    "tiny eager": (lambda p: p.write_text(_steps(5e-324, 9e8)), r"a step of 5e-324 s \(allowed: 1e-09 to 1e\+06\)"),
    "tiny compiled": (lambda p: p.write_text(_steps(9e8, 5e-324)), r"a step of 900000000\.0 s"),
    "ratio": (lambda p: p.write_text(_steps(1e-9, 9e5)), r"a compiled/eager step ratio of 9e\+14 \(allowed: "),
    "nan": (lambda p: p.write_text(_steps(float("nan"), 1.0)), r"a step of nan s"),
    "nodes": (lambda p: p.write_text(json.dumps({"format": 1, "kinds": {"cpu:default": {
        "compiles": [{"nodes": 10**30, "cpu_s": 1.0}]}}})), r"a graph of 10{30} nodes"),
    "compile": (lambda p: p.write_text(json.dumps({"format": 1, "kinds": {"cpu:default": {
        "compiles": [{"nodes": 1, "cpu_s": 1e300}]}}})), r"a compile of 1e\+300 CPU seconds"),
    "directory": (lambda p: (p.mkdir(), (p / "x").write_text("{}")), r"it is not a regular file but a directory"),
    "fifo": (_plant_fifo, r"it is not a regular file but a FIFO"),
    "socket": (lambda p: __import__("socket").socket(__import__("socket").AF_UNIX).bind(str(p)),
               r"it cannot be opened \(No such device or address\)"),
}


@pytest.mark.parametrize("kind", list(HOSTILE))
def test_a_hostile_history_gives_a_warning_and_the_defaults(tmp_path, kind):
    """Whatever is at the history's path (content, value or type of file): one warning naming why, the defaults,
    a decision the policy accepts; never a crash or a hang (the read runs on a thread that the test bounds: a
    read still blocked on a FIFO after 60 s is released by opening its other end, and fails the test). The next
    write sets it aside whole and writes a history a later read uses."""
    import threading

    path = tmp_path / history_mod.FILENAME
    HOSTILE[kind][0](path)
    before = sorted(os.listdir(tmp_path))
    got, caught = {}, []

    def read():
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            try:
                got["h"] = History(str(path))
            except BaseException as e:  # (reported below, with the test's assertion)
                got["error"] = e
        caught.extend(seen)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(60)
    if reader.is_alive():  # blocked: release it (a writer opens the FIFO), then fail
        os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
        reader.join(10)
        pytest.fail(f"reading a history that is a {kind} blocked")
    assert "error" not in got, got
    messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(messages) == 1, messages
    assert re.search(rf"not using the compile history '{re.escape(str(path))}': .*{HOSTILE[kind][1]}", messages[0]), \
        messages[0]
    h = got["h"]
    assert h.predict("cpu:default", 100) == (history_mod.DEFAULT_BASE_S + history_mod.DEFAULT_PER_NODE_S * 100,
                                             history_mod.DEFAULT_RATIO, "default")
    _judged(h)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        h.add_compile("cpu:default", 100, 5.0)
    assert sorted(os.listdir(tmp_path)) == sorted(before + [history_mod.FILENAME + ".damaged"])
    assert History(str(path)).predict("cpu:default", 100).source == "history"


def test_values_from_the_history_reach_the_policy_clamped(tmp_path):
    """The edges a history may hold, and predictions for graphs far from them: the compile stays within
    COMPILE_S (over 0.1 s), the ratio within RATIO, both finite; what no measurement gives is not recorded; a key
    of the file functrain does not read (a deep one included) is dropped, not written back."""
    path = tmp_path / "h.json"
    lo, hi = history_mod.STEP_S
    deep = "[" * 900 + "]" * 900
    path.write_text('{"format": 1, "extra": %s, "kinds": {"cpu:default": {"x": %s, "compiles": [{"nodes": 0, '
                    '"cpu_s": 1e7}, {"nodes": 1000000000, "cpu_s": 0}], "steps": [{"eager_s": %r, '
                    '"compiled_s": %r}]}}}' % (deep, deep, hi, hi * history_mod.RATIO[0]))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        h = History(str(path))
    _judged(h)
    assert h.predict("cpu:default", 10).compile_cpu_s == history_mod.COMPILE_S[1]  # 1e7 s x 10 nodes, clamped
    assert h.predict("cpu:default", 10**9).compile_cpu_s == 0.1
    h.add_steps("cpu:default", 5e-324, 9e8)  # not a measurement: not recorded
    h.add_steps("cpu:default", lo, lo)
    h.add_compile("cpu:default", -5, 1.0)
    h.add_compile("cpu:default", 7, float("inf"))
    again = json.loads(path.read_text())
    assert "extra" not in again and "x" not in again["kinds"]["cpu:default"]
    assert again["kinds"]["cpu:default"]["steps"][-1] == {"eager_s": lo, "compiled_s": lo}
    assert len(again["kinds"]["cpu:default"]["compiles"]) == 2
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _judged(History(str(path)))


@pytest.mark.parametrize("kind", ["fifo", "tiny eager"])
def test_a_run_over_a_hostile_history_trains_and_says_why(tmp_path, kind):
    """The attacker's way: planted at the real path (the history beside the run's inductor caches), a run of 40
    steps reads it, warns, decides from the defaults and trains (before: a FIFO hung the run on open; a step of
    5e-324 s killed it with the policy's ValueError)."""
    cache = _cache(tmp_path)
    HOSTILE[kind][0](cache / history_mod.FILENAME)
    r, out = _job(["fresh", "40"], _env(cache, FUNCTRAIN_COMPILE_POLICY="auto"), timeout=300)
    assert r["steps"] == 40 and r["decision"]["source"] == "default", r
    assert re.search(HOSTILE[kind][1], out.stderr) and out.stderr.count("not using the compile history") == 1, \
        out.stderr[-3000:]


# -- the Trainer's record of the decision -------------------------------------------------------------
def test_the_run_clock_reports_the_decision_once(tmp_path):
    import torch

    import functrain as ft
    from functrain.trainer.compiling import RunClock

    step = ft.train_step(lambda p, b, x: (p["w"] * x).sum(), ft.optim.sgd(0.1))
    runner = ft.compile(step).runner(donate=True, background=True)
    runner.background.budget.decision = decide(README)  # (the budget holds the decision)
    clock = RunClock(runner, compiled=True, start=0)
    clock.tick(1)
    first, second = {}, {}
    clock.fields(1, first)
    clock.fields(2, second)
    assert first["compile_decision"] == 0 and first["compile_predicted_cpu_s"] == 60.0
    assert first["compile_steps_left"] == 400 and first["compile_cores"] == 2
    assert "compile_decision" not in second
    assert any("compiling would not pay in this run" in n for n in clock.notes()), clock.notes()
    runner.close()
    del torch


def test_a_trainer_run_records_its_decision(tmp_path, monkeypatch):
    """A short compiled Trainer run on a machine whose history says compiling costs a day: it trains eagerly, and
    metrics.jsonl (once) and the summary say what was decided and why."""
    import torch

    import functrain as ft
    from functrain.compiler import budget

    pytest.importorskip("safetensors")
    h = History(str(tmp_path / "history.json"))
    h.add_compile("cpu:default", 100, 1e5)
    monkeypatch.setattr(budget.Budget, "history", lambda self: h)
    monkeypatch.setenv("FUNCTRAIN_COMPILE_POLICY", "auto")
    from functrain.compiler import capture
    capture.preload()  # the compiler imported (as in a run past its first seconds): the first call traces
    capture.wait_for_imports()
    import secrets

    width = 5 + secrets.randbelow(5000)  # a graph no earlier process compiled (this process's cache folder is
    g = torch.Generator().manual_seed(0)  # inductor's shared default: a cached graph would load, not be decided)
    x = torch.randn(64, width, generator=g)
    data = torch.utils.data.TensorDataset(x, x[:, :1] * 0.7)

    class Linear(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(width, 1)

        def forward(self, a, b):
            return torch.nn.functional.mse_loss(self.fc(a), b)

    config = ft.TrainConfig(train_batch_size=8, train_num_steps=12, save_and_sample_every=12, log_every=1,
                            results_folder=str(tmp_path / "run"), trackers=("jsonl",), compile=True)
    trainer = ft.Trainer(Linear(), data, config)
    trainer.train()
    records = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    decided = [r for r in records if "compile_decision" in r]
    assert len(decided) == 1 and decided[0]["compile_decision"] == 0, records
    assert decided[0]["compile_predicted_cpu_s"] > 1000 and decided[0]["compile_steps_left"] > 0, decided
    assert trainer.run_step.progress.workers == 0 and trainer.run_step.progress.phase == "eager"
    assert "compiling would not pay in this run" in trainer.summary()


# -- real processes ------------------------------------------------------------------------------------
def _env(cache, **extra):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT, "TORCHINDUCTOR_CACHE_DIR": str(cache),
           **{k: str(v) for k, v in extra.items()}}
    return env


def _cache(tmp_path, compile_cpu_s=None, ratio=None):
    """A private cache folder whose history says what a compile of this kind costs and gains here."""
    cache = tmp_path / "inductor"
    cache.mkdir(mode=0o700)
    if compile_cpu_s is not None:
        kind = {"compiles": [{"nodes": 100, "cpu_s": compile_cpu_s}],
                "steps": [{"eager_s": 1.0, "compiled_s": ratio}]}
        (cache / history_mod.FILENAME).write_text(json.dumps({"format": 1, "kinds": {"cpu:default": kind}}))
    return cache


def _job(args, env, timeout=600):
    out = subprocess.run([sys.executable, JOB, *args], env=env, capture_output=True, text=True, timeout=timeout)
    lines = [x for x in out.stdout.splitlines() if x.startswith("RESULT ")]
    assert out.returncode == 0 and lines, out.stdout[-3000:] + out.stderr[-3000:]
    return json.loads(lines[-1][len("RESULT "):]), out


def test_a_short_run_that_would_not_pay_trains_eagerly_and_says_so_once(tmp_path):
    """The history says a compile of this graph costs ~a day here: a 40-step run trains eagerly, says why once,
    and starts no compile worker."""
    cache = _cache(tmp_path, compile_cpu_s=1e5, ratio=0.5)
    r, out = _job(["run", "40"], _env(cache, FUNCTRAIN_COMPILE_POLICY="auto"))
    assert r["decision"]["compile"] is False and r["decision"]["source"] == "history", r
    assert r["workers"] == 0 and r["pids"] == [] and set(r["phases"]) == {"eager"}, r
    assert out.stderr.count("compiling would not pay in this run") == 1, out.stderr[-3000:]
    assert "WORKER" not in out.stdout


def test_a_first_run_that_would_not_pay_declines_before_importing_the_compiler(tmp_path):
    """A new machine (no history: the caches hold no graph of this kind) and a process that has not imported the
    compiler: after its first timed eager steps the policy judges the compile from the default's base cost
    alone and declines a 40-step run's compile without importing Dynamo or inductor (seconds of CPU the ranks'
    cores would have paid) and without a trace; said once."""
    r, out = _job(["fresh", "40"], _env(_cache(tmp_path), FUNCTRAIN_COMPILE_POLICY="auto"))
    assert r["decision"]["compile"] is False and r["decision"]["source"] == "default", r
    assert r["workers"] == 0 and set(r["phases"]) == {"eager"} and r["steps"] == 40, r
    assert not r["compiler_imported"] and not r["dynamo"], r
    assert out.stderr.count("compiling would not pay in this run") == 1, out.stderr[-3000:]


def test_a_long_run_compiles(tmp_path):
    """The history says this graph compiles in a moment and runs twice as fast: a 200000-step run compiles (the
    job stops once the compiled step has taken over)."""
    cache = _cache(tmp_path, compile_cpu_s=0.01, ratio=0.5)
    r, out = _job(["until", "200000"], _env(cache, FUNCTRAIN_COMPILE_POLICY="auto"))
    assert r["decision"]["compile"] is True and r["decision"]["remaining"] > 190000, r
    assert r["phase"] == "compiled" and r["source"] == "worker" and r["workers"] == 1, r
    assert r["phases"][:3] == ["eager"] * 3, r["phases"][:5]  # decided after a few measured eager steps
    assert out.stderr.count("functrain: compiling") == 1, out.stderr[-3000:]
    h = json.loads((cache / history_mod.FILENAME).read_text())  # the compile's outcome recorded
    compiles = h["kinds"]["cpu:default"]["compiles"]
    assert len(compiles) == 2 and compiles[-1]["cpu_s"] > 0.5, compiles


def test_compiled_ahead_a_run_starts_compiled(tmp_path):
    """precompile in one process, then a run in another: compiled from its first step (its own phase
    reporting), no worker."""
    cache = _cache(tmp_path)
    env = _env(cache, FUNCTRAIN_COMPILE_POLICY="auto")
    r, out = _job(["precompile"], env)
    assert r["seconds"] > 0 and "functrain: compiled ahead in" in out.stderr, out.stderr[-2000:]
    compiles = json.loads((cache / history_mod.FILENAME).read_text())["kinds"]["cpu:default"]["compiles"]
    assert len(compiles) == 1 and compiles[0]["cpu_s"] > 0.5 and compiles[0]["nodes"] > 10, compiles
    r, _ = _job(["run", "5"], env)
    assert r["phases"] == ["compiled"] * 5 and r["source"] == "cache" and r["workers"] == 0, r


def _group_alive(pgid):
    alive = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                if int(fields[2]) == pgid and fields[0] != "Z":
                    alive.append(int(entry))
            except (OSError, IndexError, ValueError):
                continue
    return alive


@pytest.mark.parametrize("how", ["exit", "raise", "sigterm"])
def test_no_process_of_a_run_outlives_it(tmp_path, how):
    """By default (FUNCTRAIN_COMPILE_FINISH unset) the compile worker and its compilers are gone within 1 s of
    the run's process exiting: a normal end while the worker compiles, an exception, SIGTERM."""
    env = _env(_cache(tmp_path))
    env.pop("FUNCTRAIN_COMPILE_FINISH", None)  # the default
    proc = subprocess.Popen([sys.executable, JOB, "hold" if how == "sigterm" else how], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=False)
    worker = None
    try:
        said, deadline = b"", time.monotonic() + 300
        while worker is None and time.monotonic() < deadline:  # the worker's pid, as the code reports it
            ready, _, _ = select.select([proc.stdout], [], [], 1.0)
            chunk = os.read(proc.stdout.fileno(), 4096) if ready else b""
            if ready and not chunk:
                break
            said += chunk
            for line in said.decode(errors="replace").splitlines():
                if line.startswith("WORKER "):
                    worker = int(line.split()[1])
        assert worker is not None, said.decode(errors="replace")[-2000:] + proc.stderr.read().decode()[-3000:]
        if how == "sigterm":
            proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=120)
        exited = time.monotonic()  # the run's process has exited (reaped)
        while _group_alive(worker) and time.monotonic() < exited + 30:
            time.sleep(0.01)
        took = time.monotonic() - exited
        left = _group_alive(worker)
        print(f"{how}: the worker's group was gone {took:.3f} s after the run's process exited")
        assert not left and took <= 1.0, f"{how}: still alive {took:.2f} s after the run exited: {left}"
        if how == "exit":
            assert proc.returncode == 0
        assert b"goes on in process" not in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
        if worker is not None and _group_alive(worker):
            os.killpg(worker, signal.SIGKILL)


def _two_ranks_worker(steps_by_rank, pin_rank_1):
    """One rank of a data-parallel run whose ranks see different numbers: run lengths ``steps_by_rank``, and
    (``pin_rank_1``) rank 1 on one core of the machine's. Steps until the compile policy has decided (at most 40
    calls), then stops (a compile decided is stopped by ``close``). Returns the decision's record, the paths, and
    the lines this rank said on stderr."""
    import contextlib
    import io

    import torch
    import torch.distributed as dist

    import functrain as ft
    from functrain.compiler import capture

    rank = dist.get_rank()
    if rank == 1 and pin_rank_1:
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    capture.preload()  # the compiler imported first: the first call traces
    capture.wait_for_imports()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    apply_fn, params, buffers = ft.functionalize(model)

    def loss_fn(p, b, batch):
        return torch.nn.functional.mse_loss(apply_fn(p, b, batch[0]), batch[1])

    step = ft.data_parallel()(ft.train_step(loss_fn, ft.optim.adamw(1e-2)))
    run = ft.compile(step).runner(donate=True, background=True)
    run.expect(steps_by_rank[rank])
    state = ft.tree.tree_map(torch.clone, step.init(params, buffers))
    g = torch.Generator().manual_seed(1)
    paths, said = [], io.StringIO()
    with contextlib.redirect_stderr(said):
        for i in range(40):
            x, y = torch.randn(8, 4, generator=g), torch.randn(8, 3, generator=g)
            before = run.progress.eager_calls
            state, _ = run(state, (x[rank::2], y[rank::2]))
            paths.append("eager" if run.progress.eager_calls != before else "compiled")
            if run.background.decision is not None:
                break
        run.background.close()
    d = run.background.decision
    return {"paths": paths, "record": d.record() if d is not None else None, "phase": run.progress.phase,
            "declined": len(run.background.declined), "worker_pid": run.progress.worker_pid,
            "cores": len(os.sched_getaffinity(0)),
            "said": [x for x in said.getvalue().splitlines() if x.startswith("functrain: ")]}


@pytest.mark.parametrize("steps, compiles", [({0: 10**7, 1: 40}, False), ({0: 10**7, 1: 10**7}, True)],
                         ids=["decline", "compile"])
def test_ranks_decide_once_from_one_set_of_numbers(tmp_path, steps, compiles):
    """Two gloo ranks with different numbers (run lengths; rank 1 on one core): every rank decides at the same
    call, from the same combined numbers (the fewest steps left, the fewest cores), the same decision in each
    rank's record; one line on stderr, rank 0's; a decline starts no compile on any rank (issue 40: before, rank
    0 said "compiling ..." from its numbers, rank 1 declined from its own, and the run said both)."""
    import functrain as ft

    cache = _cache(tmp_path, compile_cpu_s=0.01, ratio=0.5)
    env = {"TORCHINDUCTOR_CACHE_DIR": str(cache), "FUNCTRAIN_COMPILE_POLICY": "auto", "OMP_NUM_THREADS": "1"}
    pin = len(os.sched_getaffinity(0)) > 1
    a, b = ft.launch(_two_ranks_worker, nprocs=2, args=(steps, pin), timeout=600, env=env)
    assert a["record"] is not None and a["record"] == b["record"], (a, b)
    assert a["record"]["compile"] is compiles, a
    assert len(a["paths"]) == len(b["paths"]) and set(a["paths"]) == set(b["paths"]) == {"eager"}, (a, b)
    decided_at = len(a["paths"])  # (calls made, the deciding one included: 1 untimed + DECIDE_AFTER timed)
    assert a["record"]["remaining"] == min(steps.values()) - decided_at + 1, a["record"]  # the fewest steps left
    assert a["record"]["cores"] == min(a["cores"], b["cores"]) and (b["cores"] == 1 or not pin), (a, b)
    assert len(a["said"]) == 1 and b["said"] == [], (a["said"], b["said"])
    assert a["said"][0] == "functrain: " + a["record"]["why"], a["said"]
    if not compiles:
        assert a["declined"] == b["declined"] == 1 and a["worker_pid"] is None, (a, b)


_COMPILERS = ("g++", "gcc", "cc", "c++", "cc1plus", "cc1", "as", "ld", "collect2")


def _table():
    """The process table: ``{pid: (comm, ppid, session)}`` of the live (not zombie) processes."""
    table = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    text = f.read()
                comm = text[text.index("(") + 1:text.rindex(")")]
                fields = text.rsplit(")", 1)[1].split()
                if fields[0] != "Z":
                    table[int(entry)] = (comm, int(fields[1]), int(fields[3]))
            except (OSError, IndexError, ValueError):
                continue
    return table


def _descendants(table, root):
    kids, found, todo = {}, set(), [root]
    for pid, (_, ppid, _) in table.items():
        kids.setdefault(ppid, []).append(pid)
    while todo:
        for child in kids.get(todo.pop(), ()):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def test_sigkill_of_precompile_mid_compile_leaves_no_compiler(tmp_path):
    """precompile's process SIGKILLed while a C++ compiler of its compile runs: within 1 s no g++/cc1plus of it
    (of its session, or of a session one of its children started) is left: nothing outlives a run, its compilers
    included (issue 36). The compiler is a ``g++`` that waits 60 s before it runs the real one: a real compile of
    this small graph takes less than a second here, so the kill could otherwise land between two of them."""
    slow = tmp_path / "g++"
    slow.write_text(f'#!/bin/sh\nsleep 60\nexec {shutil.which("g++")} "$@"\n')
    slow.chmod(0o700)
    env = _env(_cache(tmp_path), SLOW_CXX=slow)
    proc = subprocess.Popen([sys.executable, JOB, "precompile-slow"], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, start_new_session=True)
    sessions, compilers = set(), []
    try:
        deadline = time.monotonic() + 400
        while not compilers and time.monotonic() < deadline and proc.poll() is None:  # a compiler of it runs
            table = _table()
            mine = _descendants(table, proc.pid)
            compilers = [p for p in mine if table[p][0] in _COMPILERS]
            sessions = {table[p][2] for p in mine} | {proc.pid}
            if not compilers:
                time.sleep(0.01)
        assert compilers, f"no compiler of precompile was seen (exit {proc.poll()}): " + \
            (proc.stderr.read().decode()[-3000:] if proc.poll() is not None else "")
        proc.kill()
        proc.wait(timeout=60)
        killed = time.monotonic()
        while time.monotonic() < killed + 30:
            left = [(p, c) for p, (c, _, sid) in _table().items() if sid in sessions and c in _COMPILERS]
            if not left:
                break
            time.sleep(0.01)
        took = time.monotonic() - killed
        print(f"precompile SIGKILLed: its compilers were gone {took:.3f} s later")
        assert not left and took <= 1.0, f"compilers of the killed precompile alive {took:.2f} s later: {left}"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
        for pid, (c, _, sid) in _table().items():  # (a failed run leaves nothing behind either)
            if sid in sessions and sid != os.getsid(0):
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
