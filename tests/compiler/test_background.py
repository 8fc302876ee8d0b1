"""Background compilation: eager steps from the first call, the compiled step swapped in when ready.

The tests that need inductor's real worker run the step in a process of their own
(``background_job.py``) with a cache folder of their own, so "cold" means cold; the
policy tests (switch at a step, a second signature, donation, a graph break) use the
``aot_eager`` backend, compiled on the training thread at once, in this process.
"""
import json
import os
import signal
import subprocess
import sys
import time
import warnings

import pytest
import torch

import functrain as ft
from functrain import tree as T

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
JOB = os.path.join(HERE, "background_job.py")


def _env(cache, **extra):
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT, "TORCHINDUCTOR_CACHE_DIR": str(cache),
            **{k: str(v) for k, v in extra.items()}}


def _job(mode, cache, timeout=900, **env):
    out = subprocess.run([sys.executable, JOB, mode], env=_env(cache, **env), capture_output=True, text=True,
                         timeout=timeout)
    lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
    assert out.returncode == 0 and lines, out.stdout[-3000:] + out.stderr[-3000:]
    return json.loads(lines[-1][len("RESULT "):])


def _workers_of(pid):
    """The compile workers whose parent is ``pid`` (their command line names it), still alive."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
            with open(f"/proc/{entry}/stat") as f:
                zombie = f.read().split()[2] == "Z"
        except OSError:
            continue
        if b"functrain.compiler.worker" in argv and str(pid).encode() in argv and not zombie:
            found.append(int(entry))
    return found


def _group_alive(pgid):
    """Processes of process group ``pgid`` still running (a worker is its own group, its compilers in it)."""
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


# ------------------------------------------------------------------------------------------ the real worker
@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("inductor")


def test_first_call_returns_before_the_compile_then_the_compiled_code_runs(cache):
    cold = _job("swap", cache)
    # the first call is the eager step: it returns while the worker process compiles
    assert cold["phase_after_first"] == "compiling" and cold["worker_alive_after_first"], cold
    assert cold["first_call_s"] < cold["compile_s"], cold
    assert cold["phase"] == "compiled" and cold["switch_call"] > 1 and cold["source"] == "worker", cold
    assert cold["eager_equal_bitwise"], "an eager call during the compile differs from the eager step"
    # after the swap every call runs the compiled code: not one Python call of the loss in 20 steps
    assert cold["loss_calls_after_swap"] == 0, cold
    assert cold["compiles"] == 1 and cold["close"], cold  # one graph; compiled == eager to float rounding
    assert cold["worker_gone"], cold
    # a second process finds the worker's entries in the caches: loaded as soon as it traces (once the
    # compiler's modules are imported), no worker compiles
    warm = _job("swap", cache)
    assert warm["source"] == "cache" and warm["compile_s"] < cold["compile_s"], warm
    assert warm["loss_calls_after_swap"] == 0 and warm["close"] and warm["compiles"] == 1, warm


def _hanging_compiler(folder):
    """The environment of a training process whose compile worker's C++ compiler never returns: in the worker
    (which runs 10 above the training process's niceness, FUNCTRAIN_COMPILE_NICE) the compiler sleeps far past
    every timeout the tests set; in the training process (inductor's CPU probes run there) it is g++."""
    path = folder / "hang-cxx.sh"
    above = os.nice(0) + 5  # this process's niceness, which the training process inherits, plus 5
    path.write_text(f'#!/bin/sh\nif [ "$(nice)" -ge {above} ]; then exec sleep 3600; fi\nexec g++ "$@"\n')
    path.chmod(0o700)
    return {"HANG_CXX": str(path), "FUNCTRAIN_COMPILE_NICE": 10}


@pytest.mark.parametrize("mode, reason", [
    ("fail", "the compile worker (pid {pid}) failed: "),
    ("die", "the compile worker (pid {pid}) was killed by signal SIGKILL"),
    ("hang", "the compile worker (pid {pid}) did not finish within 20 s (FUNCTRAIN_COMPILE_TIMEOUT); it was stopped"),
    ("held", "the process compiling this graph on this machine did not finish within 20 s (FUNCTRAIN_COMPILE_TIMEOUT)"),
])
def test_a_failing_dead_or_hung_worker_leaves_eager_training_and_one_warning(tmp_path, mode, reason):
    r = _job(mode, tmp_path, FUNCTRAIN_COMPILE_TIMEOUT=20, **(_hanging_compiler(tmp_path) if mode == "hang" else {}))
    assert r["phase"] == "failed", r
    assert len(r["warnings"]) == 1, r["warnings"]  # said once, and training went on
    pid = r["reason"].split("pid ")[1].split(")")[0] if "pid " in r["reason"] else "?"
    assert reason.format(pid=pid) in r["warnings"][0], r["warnings"]
    assert "training on with the eager step" in r["warnings"][0]
    assert r["eager_equal_bitwise"] and r["worker_gone"], r
    # one worker had the graph; none where another process holds the graph's lock (this one followed it)
    assert r["workers"] == (0 if mode == "held" else 1), r


def test_a_corrupt_cache_entry_is_rebuilt_never_loaded(tmp_path):
    r = _job("corrupt", tmp_path)
    assert r["ready"] and r["damaged"] > 0, r
    assert any("did not load here" in w for w in r["warnings"]), r["warnings"]
    assert r["phase"] == "compiled" and r["compiles"] == 1 and r["close"], r


def test_no_orphan_worker_after_sigkill_of_the_training_process(tmp_path):
    proc = subprocess.Popen([sys.executable, JOB, "hold"], env=_env(tmp_path), stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True)
    try:
        line = ""
        deadline = time.monotonic() + 120
        while not line.startswith("WORKER ") and time.monotonic() < deadline:
            line = proc.stdout.readline()
        assert line.startswith("WORKER "), "no compile worker was started"
        worker = int(line.split()[1])
        time.sleep(3.0)  # it compiles now (a cold cache: tens of seconds)
        assert _workers_of(proc.pid) == [worker]
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
    deadline = time.monotonic() + 30
    while (_workers_of(proc.pid) or _group_alive(worker)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _workers_of(proc.pid), "the compile worker outlived the training process"
    assert not _group_alive(worker), f"its compilers outlived it: {_group_alive(worker)}"


def test_a_follower_whose_compiling_process_is_killed_compiles_itself(tmp_path):
    """One process per machine compiles a graph: a second process (local rank 1) that finds the graph's lock held
    starts no worker and waits for the first. When the first is SIGKILLed mid-compile (its worker dies with it and
    the kernel frees the lock), the follower finds nothing in the caches and compiles the graph itself: no hang,
    no warning, compiled in the end. (The first process's worker never finishes: its C++ compiler hangs.)"""
    leader = subprocess.Popen([sys.executable, JOB, "hold"],
                              env=_env(tmp_path, LOCAL_RANK=0, **_hanging_compiler(tmp_path)),
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    follower, worker = None, None
    try:
        line, deadline = "", time.monotonic() + 120
        while not line.startswith("WORKER ") and time.monotonic() < deadline:
            line = leader.stdout.readline()
        assert line.startswith("WORKER "), "the first process started no compile worker"
        worker = int(line.split()[1])
        follower = subprocess.Popen([sys.executable, JOB, "follow"], env=_env(tmp_path, LOCAL_RANK=1),
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        said = follower.stdout.readline()
        assert said.strip() == "FOLLOWING", said + follower.stderr.read()[-3000:] if follower.poll() is not None \
            else said
        os.kill(leader.pid, signal.SIGKILL)
        leader.wait(timeout=30)
        out, err = follower.communicate(timeout=600)
    finally:
        for proc in (leader, follower):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait(timeout=30)
        if worker is not None:  # the dead worker's hanging compiler (its process group)
            try:
                os.killpg(worker, signal.SIGKILL)
            except ProcessLookupError:
                pass
    lines = [x for x in out.splitlines() if x.startswith("RESULT ")]
    assert follower.returncode == 0 and lines, out[-3000:] + err[-3000:]
    r = json.loads(lines[-1][len("RESULT "):])
    assert r["phase"] == "compiled" and r["source"] == "worker" and r["workers"] == 1, r
    assert r["compiles"] == 1 and not r["warnings"], r


def test_a_run_shorter_than_its_compile_leaves_the_next_run_compiled(tmp_path):
    """ft.run ends (3 steps) while its worker compiles cold: the worker says so on stderr and finishes after the
    process has exited; the next run of the same step loads the code from the caches at its first trace and runs
    compiled from its second step. With FUNCTRAIN_COMPILE_FINISH=0 the worker dies with the run."""
    out = subprocess.run([sys.executable, JOB, "short"], env=_env(tmp_path, FUNCTRAIN_COMPILE_FINISH=1),
                         capture_output=True, text=True, timeout=300)
    lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
    assert out.returncode == 0 and lines, out.stdout[-3000:] + out.stderr[-3000:]
    r = json.loads(lines[-1][len("RESULT "):])
    assert r["phase"] == "compiling" and r["eager_calls"] == 3 and r["worker_pid"], r  # the run ended first
    worker = r["worker_pid"]
    assert f"the background compile goes on in process {worker}" in out.stderr, out.stderr[-2000:]
    deadline = time.monotonic() + 400
    while _group_alive(worker) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _group_alive(worker), "the detached worker did not finish in time"
    r = _job("again", tmp_path, FUNCTRAIN_COMPILE_FINISH=0)
    assert r["source"] == "cache" and r["phase"] == "compiled" and r["compiles"] == 1, r
    assert r["compiled_from_step"] is not None and r["compiled_from_step"] <= 2, r

    # opted out: the same short run on a cold folder leaves no worker behind
    cold = tmp_path / "cold"
    out = subprocess.run([sys.executable, JOB, "short"], env=_env(cold, FUNCTRAIN_COMPILE_FINISH=0),
                         capture_output=True, text=True, timeout=300)
    lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
    assert out.returncode == 0 and lines, out.stdout[-3000:] + out.stderr[-3000:]
    worker = json.loads(lines[-1][len("RESULT "):])["worker_pid"]
    assert worker and "goes on in process" not in out.stderr
    deadline = time.monotonic() + 30
    while _group_alive(worker) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _group_alive(worker), f"the worker outlived a run that opted out: {_group_alive(worker)}"


def test_a_worker_left_to_finish_is_still_bounded_by_its_timeout(tmp_path):
    """A worker left to finish after its run (which no parent watches any more) kills itself and its compilers
    at FUNCTRAIN_COMPILE_TIMEOUT: here its C++ compiler never returns."""
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, JOB, "short"],
                         env=_env(tmp_path, FUNCTRAIN_COMPILE_FINISH=1, FUNCTRAIN_COMPILE_TIMEOUT=15,
                                  **_hanging_compiler(tmp_path)),
                         capture_output=True, text=True, timeout=300)
    lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
    assert out.returncode == 0 and lines, out.stdout[-3000:] + out.stderr[-3000:]
    worker = json.loads(lines[-1][len("RESULT "):])["worker_pid"]
    assert f"goes on in process {worker}" in out.stderr and _group_alive(worker), out.stderr[-2000:]
    while _group_alive(worker) and time.monotonic() - t0 < 60:
        time.sleep(0.2)
    assert not _group_alive(worker), "the detached worker or its compiler ran past its timeout"
    assert time.monotonic() - t0 >= 10, "the worker ended before its timeout: its compiler did not hang"


# ------------------------------------------------------------------------------------------ policies (aot_eager)
@pytest.fixture(autouse=True)
def _compiler_imported():
    """The first trace waits for the compiler's modules, which a thread imports (seconds) while calls run
    eagerly: have them imported, so that the tests below can count which call traced."""
    from functrain.compiler import capture
    capture.preload()
    capture.wait_for_imports()


def _problem(dropout=0.1):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Dropout(dropout),
                                torch.nn.Linear(8, 2))
    apply_fn, params, buffers = ft.functionalize(model)
    calls = [0]

    def loss_fn(p, b, batch):
        calls[0] += 1
        return torch.nn.functional.mse_loss(apply_fn(p, b, batch[0]), batch[1])

    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(6, 4, generator=g), torch.randn(6, 2, generator=g)) for _ in range(4)]
    return ft.train_step(loss_fn, ft.optim.adamw(1e-2)), params, buffers, batches, calls


def test_switch_at_runs_eagerly_before_the_step_and_compiled_from_it():
    step, params, buffers, batches, calls = _problem()
    cstep = ft.compile(step, backend="aot_eager", switch_at=5)
    state = ref = step.init(params, buffers)
    ran_python = []
    for i in range(9):
        before = calls[0]
        state, _ = cstep(state, batches[i % 4])
        ran_python.append(calls[0] - before)
        ref, _ = step(ref, batches[i % 4])
        if i < 5:
            assert T.tree_equal(state, ref), f"call {i + 1} (eager) differs from the eager step"
    # calls 1-5 take states that made 0-4 steps: eager (call 1 also traces); from the state at 5 on: compiled
    assert ran_python == [2, 1, 1, 1, 1, 0, 0, 0, 0], ran_python
    assert cstep.progress.phase == "compiled" and cstep.compiles == 1
    assert T.tree_allclose(state, ref, rtol=1e-5, atol=1e-6)
    # a run resumed past the switch starts compiled (blocking): a new compiled step, a state at step 9
    again = ft.compile(step, backend="aot_eager", switch_at=5)
    before = calls[0]
    state, _ = again(state, batches[0])
    assert calls[0] - before == 1 and again.progress.eager_calls == 0  # traced once, ran compiled


def test_a_graph_break_trains_on_eagerly_with_one_warning():
    step, params, buffers, batches, calls = _problem(dropout=0.0)
    base_loss = step.loss_fn

    def syncing(p, b, batch):
        loss = base_loss(p, b, batch)
        return loss * 2 if loss.item() > 0 else loss  # a host sync: not one graph

    bad = ft.train_step(syncing, ft.optim.adamw(1e-2))
    cstep = ft.compile(bad, background=True, backend="aot_eager")
    state = ref = bad.init(params, buffers)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i in range(6):
            state, _ = cstep(state, batches[i % 4])
            ref, _ = bad(ref, batches[i % 4])
    said = [str(w.message) for w in caught if "background compile" in str(w.message)]
    assert len(said) == 1, said
    assert "GraphBreakError: the step cannot be compiled as one graph" in said[0] and "host sync" in said[0]
    assert cstep.progress.phase == "failed" and cstep.compiles == 0
    assert T.tree_equal(state, ref)  # the eager step, unchanged


def test_a_second_signature_runs_eagerly_while_it_compiles_then_compiled():
    step, params, buffers, batches, calls = _problem(dropout=0.0)
    cstep = ft.compile(step, background=True, backend="aot_eager")
    state = step.init(params, buffers)
    small = [(x[:3], y[:3]) for x, y in batches]
    counts = []
    for b in [batches[0], batches[1], batches[2], small[0], small[1], small[2], batches[3], small[3]]:
        before = calls[0]
        state, _ = cstep(state, b)
        counts.append(calls[0] - before)
    # big: eager + trace, then compiled; small: eager + trace, then compiled; both graphs kept
    assert counts == [2, 0, 0, 2, 0, 0, 0, 0], counts
    assert cstep.compiles == 2


def test_the_donating_form_retires_eager_states_and_owns_the_state_at_the_switch():
    step, params, buffers, batches, calls = _problem(dropout=0.0)
    cstep = ft.compile(step, backend="aot_eager")
    run = cstep.runner(donate=True, background=True)  # what ft.run uses
    assert cstep.progress is not run.progress and run.progress.phase == "eager"  # the runner's own
    ref = step.init(params, buffers)
    state = old = T.tree_map(torch.clone, ref)  # the caller's copy, owned by the loop
    state, _ = run(state, batches[0])  # eager (and traced)
    ref, _ = step(ref, batches[0])
    with pytest.raises(RuntimeError, match="was donated"):
        run(old, batches[1])  # a donated state cannot be stepped again, eager or compiled
    for i in range(1, 5):
        state, _ = run(state, batches[i % 4])
        ref, _ = step(ref, batches[i % 4])
    assert run.progress.phase == "compiled" and run.progress.eager_calls == 1
    assert T.tree_allclose(state, ref, rtol=1e-5, atol=1e-6)
    # ft.compile(step) called directly still waits for its compile (a benchmark's expectation)
    assert not cstep.background and cstep._own.background is None


def test_bad_choices_are_refused(monkeypatch):
    step, *_ = _problem()
    for bad in ("-1", "soon"):
        monkeypatch.setenv("FUNCTRAIN_COMPILE_FOLLOW_S", bad)
        with pytest.raises(ValueError,
                           match=rf"FUNCTRAIN_COMPILE_FOLLOW_S must be a number of seconds >= 0; got '{bad}'"):
            ft.compile(step, background=True)
    monkeypatch.delenv("FUNCTRAIN_COMPILE_FOLLOW_S")
    with pytest.raises(ValueError, match=r"background=True / switch_at=\) compiles the direct capture"):
        ft.compile(step, background=True, fullgraph=False)
    with pytest.raises(ValueError, match=r"switch_at must be an int >= 0"):
        ft.compile(step, switch_at=-1)
    with pytest.raises(ValueError, match=r"switch_at=3\) is when a background compile takes over"):
        ft.compile(step, switch_at=3, background=False)
    with pytest.raises(ValueError, match=r"background must be one of"):
        ft.compile(step, background="yes")


def test_run_compiles_in_the_background_and_its_bar_says_so(capsys):
    pytest.importorskip("tqdm")
    step, params, buffers, batches, calls = _problem(dropout=0.0)
    cstep = ft.compile(step, backend="aot_eager", switch_at=20)

    def slow():  # the bar redraws at most every 0.1 s: give it time to show each phase
        for i in range(40):
            time.sleep(0.03)
            yield batches[i % 4]

    run = cstep.runner(donate=True, background=True)  # what ft.run makes; given, ft.run runs it
    state = ft.run(run, step.init(params, buffers), slow(), num_steps=40, log_every=10)
    assert int(state.step) == 40 and run.progress.phase == "compiled" and run.progress.eager_calls == 20
    err = capsys.readouterr().err
    assert "compiled, switching at step 20 · eager " in err, err[-2000:]
    assert "compiled " in err.split("switching at step 20")[-1] and "(eager " in err, err[-2000:]


def test_the_bar_says_compiling_while_a_worker_compiles():
    step, params, buffers, batches, calls = _problem(dropout=0.0)
    cstep = ft.compile(step)  # inductor: a worker process compiles it (seconds)
    run = cstep.runner(donate=True, background=True)  # ft.run's runner
    rates = run.rates  # its one rate meter, recorded by the runner at every call
    state = T.tree_map(torch.clone, step.init(params, buffers))
    try:
        for i in range(1, 4):
            state, _ = run(state, batches[i % 4])
        assert run.progress.phase in ("compiling", "ready") and rates.calls["eager"] == 3
        assert rates.describe(run.progress).startswith(("compiling in the background · eager",
                                                        "compiled, switching")), rates.describe(run.progress)
    finally:
        cstep.close()
    assert run.progress.worker_pid is None or not _workers_of(os.getpid())
