"""ft.Trainer under faults: NaN samples, SIGTERM with rare log steps, two runs on one folder, slow samples,
damaged newest checkpoints, a changed state structure.

In-process runs are eager (compile=False) and one process; multi-process runs use `python -m functrain.launch`
on 2 ranks over gloo, each with a timeout.
"""
import os
import re
import signal
import subprocess
import sys
import time
import warnings

import pytest
import torch

import functrain as ft
from functrain import checkpoint as ck
from functrain import tree as T

pytest.importorskip("safetensors")

HERE = os.path.dirname(os.path.abspath(__file__))
JOB = os.path.join(HERE, "trainer_job.py")
ROOT = os.path.dirname(os.path.dirname(HERE))  # the repository (tests/trainer -> tests -> root)


class Linear(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 1)

    def forward(self, x, y):
        return torch.nn.functional.mse_loss(self.fc(x), y)


def _data(nan_rows=(), n=64):
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(n, 4, generator=g), torch.randn(n, 1, generator=g)
    for r in nan_rows:
        x[r, 2] = float("nan")
    return torch.utils.data.TensorDataset(x, y)


def _config(folder, **kw):
    base = dict(train_batch_size=8, train_num_steps=60, save_and_sample_every=5, keep_checkpoints=3,
                results_folder=str(folder), compile=False, log_every=10, ema_update_every=1, ema_update_after_step=0,
                trackers=())
    return ft.TrainConfig(**{**base, **kw})


def _train(config, data):
    torch.manual_seed(0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        state = ft.Trainer(Linear(), data, config).train()
    return state, [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]


def _finite(tree):
    return bool(T.tree_all_finite([t for t in T.tree_leaves(tree) if t.is_floating_point()]))


# ------------------------------------------------------------------------------------------ 1. non-finite steps
def test_a_nan_sample_costs_no_data_and_is_reported(tmp_path):
    """A default fp32 run over a dataset with one NaN feature: the NaN batches are skipped with a warning."""
    state, warned = _train(_config(tmp_path), _data(nan_rows=[5]))
    assert _finite(state.params) and _finite(state.ema)
    skipped = int(state.slots["skip_nonfinite"]["skipped"])
    assert skipped >= 60 // 8 - 1  # the batch holding row 5, about once per epoch of 8 updates
    reports = [w for w in warned if re.search(r"step \d+: \d+ of the last \d+ updates skipped", w)]
    assert reports, warned
    assert int(re.search(r"(\d+) in this run", reports[-1]).group(1)) == skipped
    mgr = ft.CheckpointManager(tmp_path / "checkpoints")
    assert mgr.steps() == [50, 55, 60]
    for s in mgr.steps():
        restored = ft.load(mgr.path(s))
        assert _finite(restored.params) and _finite(restored.ema), s


def test_without_skipping_rotation_keeps_the_newest_finite_checkpoint(tmp_path):
    """skip_nonfinite=False: the params turn NaN; the last finite checkpoint survives rotation, with a warning."""
    state, warned = _train(_config(tmp_path, skip_nonfinite=False, save_and_sample_every=1), _data(nan_rows=[5]))
    assert not _finite(state.params)
    mgr = ft.CheckpointManager(tmp_path / "checkpoints")
    steps = mgr.steps()
    assert steps[-3:] == [58, 59, 60] and len(steps) == 4 and steps[0] < 58, steps  # keep 3 + the newest finite
    good = ft.load(mgr.path(steps[0]))
    assert _finite(good.params) and _finite(good.ema)
    assert mgr.newest_finite() == steps[0]
    assert any("holds non-finite parameters" in w and f"step_{steps[0]:08d}" in w for w in warned), warned
    assert any("the loss is nan and skip_nonfinite is off" in w for w in warned), warned


def test_too_many_nonfinite_updates_in_a_row_stop_the_run(tmp_path):
    bad = _data(nan_rows=range(64))
    config = _config(tmp_path, max_consecutive_nonfinite=5, log_every=100, save_and_sample_every=1000)
    with pytest.raises(FloatingPointError, match=r"5 updates in a row up to step 5 .*max_consecutive_nonfinite=5"):
        _train(config, bad)
    mgr = ft.CheckpointManager(tmp_path / "checkpoints")
    assert mgr.steps() == [5]  # the progress is saved before stopping
    torch.manual_seed(0)
    initial = ft.Trainer(Linear(), bad, config).initial_state()
    assert T.tree_equal(ft.load(mgr.path(5)).params, initial.params)  # every update was skipped


# ------------------------------------------------------------------------------------------ 5. resume fallback
@pytest.mark.parametrize("damage", ["extra", "truncated"])
def test_damaged_newest_checkpoint_falls_back_with_a_warning(tmp_path, damage):
    data = _data()
    ref, _ = _train(_config(tmp_path / "ref", train_num_steps=12, save_and_sample_every=4), data)
    run = tmp_path / "run"
    _train(_config(run, train_num_steps=8, save_and_sample_every=4), data)
    newest = ft.CheckpointManager(run / "checkpoints").path(8)
    if damage == "extra":
        with open(os.path.join(newest, ck.EXTRA), "r+b") as f:
            f.write(b"#")
        reason = "extra.json: its sha256 does not match"
    else:
        f = os.path.join(newest, ck.TENSORS)
        os.truncate(f, os.path.getsize(f) // 2)
        reason = "truncated"
    state, warned = _train(_config(run, train_num_steps=12, save_and_sample_every=4), data)
    assert any(f"skipping checkpoint {newest}" in w and reason in w and "step_00000004" in w for w in warned), warned
    assert T.tree_equal(state, ref)  # resumed from step 4: the same result as the uninterrupted run


def test_a_different_state_structure_is_refused_before_reading_tensors(tmp_path, monkeypatch):
    _train(_config(tmp_path, train_num_steps=5, skip_nonfinite=False), _data())

    def no_tensors(*args, **kwargs):
        raise AssertionError("tensors were read")

    monkeypatch.setattr(ck.folder, "load_tensors", no_tensors)
    with pytest.raises(ValueError, match=r"structure differs.*'slots'.*skip_nonfinite.*\(False, True\)"):
        _train(_config(tmp_path, train_num_steps=10), _data())


# ------------------------------------------------------------------------------------------ subprocess jobs
def _env(**extra):
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT, "FUNCTRAIN_DIST_TIMEOUT": "60", **extra}


def _cmd(results, nproc, *args):
    job = [JOB, str(results), *map(str, args)]
    return [sys.executable, *job] if nproc == 1 else [sys.executable, "-m", "functrain.launch", "--nproc",
                                                      str(nproc), *job]


def _wait_for(path, proc, timeout=180):
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        assert proc.poll() is None, f"the job ended early:\n{proc.stdout.read()[-3000:]}"
        assert time.monotonic() < deadline, f"no {path} in time"
        time.sleep(0.05)


def _kill(proc):
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)


def test_sigterm_on_two_processes_saves_in_time_with_rare_log_steps(tmp_path):
    """log_every (1000 steps, ~100 s) far beyond torchrun's 30 s grace: the ranks still agree within seconds."""
    proc = subprocess.Popen(_cmd(tmp_path, 2, "--no-compile", "--steps", 2000, "--log-every", 1000,
                                 "--save-every", 5, "--step-sleep", 0.1), env=_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        _wait_for(os.path.join(tmp_path, "checkpoints", "step_00000005", "COMPLETE.json"), proc)
        sent = time.monotonic()
        os.killpg(proc.pid, signal.SIGTERM)
        out, _ = proc.communicate(timeout=120)
        took = time.monotonic() - sent
    finally:
        _kill(proc)
    done = re.findall(r"DONE step=(\d+) rank=(\d+)", out)
    assert sorted(rank for _, rank in done) == ["0", "1"], out[-3000:]
    steps = {int(step) for step, _ in done}
    assert len(steps) == 1, done
    step = steps.pop()
    assert 5 <= step < 2000
    assert ft.CheckpointManager(tmp_path / "checkpoints").steps()[-1] == step
    assert proc.returncode == 128 + signal.SIGTERM  # as documented: the launcher reports it was stopped
    assert took < 25, f"{took:.1f} s from SIGTERM to exit: beyond the bound"


def test_sigterm_after_the_steps_slow_down_saves_within_a_step_and_says_so(tmp_path):
    """150 fast steps, then 1 s steps; SIGTERM to the launcher (--term-timeout 10): the ranks must not keep
    running on an agreement interval learnt from the fast steps. Both stop at the same step within about a
    step of the signal, rank 0 saves it, and the launcher exits 143 (every rank ended by itself: saved)."""
    args = ("--nproc", 2, "--term-timeout", 10, JOB, tmp_path, "--no-compile", "--steps", 1000, "--log-every", 50,
            "--save-every", 150, "--step-sleep", 1.0, "--slow-after", 150, "--precision", "no")
    proc = subprocess.Popen([sys.executable, "-m", "functrain.launch", *map(str, args)],
                            env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        _wait_for(os.path.join(tmp_path, "checkpoints", "step_00000150", "COMPLETE.json"), proc)
        time.sleep(2.5)  # two slow steps in
        sent = time.time()
        proc.send_signal(signal.SIGTERM)  # to the launcher: forwarded to the ranks, SIGKILL 10 s later
        out, _ = proc.communicate(timeout=120)
        took = time.time() - sent
    finally:
        _kill(proc)
    steps = ft.CheckpointManager(tmp_path / "checkpoints").steps()
    assert steps[-1] > 150, f"no checkpoint after the SIGTERM (steps {steps}):\n{out[-3000:]}"
    done = re.findall(r"DONE step=(\d+) rank=(\d+)", out)
    assert sorted(rank for _, rank in done) == ["0", "1"], out[-3000:]
    assert {int(step) for step, _ in done} == {steps[-1]}, done
    saved = os.stat(tmp_path / "checkpoints" / f"step_{steps[-1]:08d}" / "COMPLETE.json").st_mtime - sent
    print(f"SIGTERM at ~step {150 + 2}: saved step {steps[-1]} {saved:.1f} s later, exit after {took:.1f} s")
    assert saved < 3 * 1.0 + 4, f"the checkpoint came {saved:.1f} s after SIGTERM: more than about a step"
    assert proc.returncode == 128 + signal.SIGTERM, out[-3000:]
    assert "every rank ended by itself" in out, out[-3000:]


def test_a_slow_sample_fn_beyond_the_collective_timeout_is_not_a_failure(tmp_path):
    out = subprocess.run(_cmd(tmp_path, 2, "--no-compile", "--steps", 4, "--save-every", 2, "--slow", 8),
                         env=_env(FUNCTRAIN_DIST_TIMEOUT="3"), capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert ft.CheckpointManager(tmp_path / "checkpoints").steps()[-1] == 4
    assert os.path.exists(tmp_path / "sample-4.png")


def test_a_second_run_on_the_same_folder_is_refused_and_the_first_is_intact(tmp_path):
    ref = tmp_path / "ref"
    out = subprocess.run(_cmd(ref, 1, "--no-compile", "--steps", 30, "--precision", "no"), env=_env(),
                         capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    run = tmp_path / "run"
    hold = tmp_path / "go-on"  # the first run waits for it after step 2: alive while the second one tries
    first = subprocess.Popen(_cmd(run, 1, "--no-compile", "--steps", 30, "--precision", "no", "--hold", hold),
                             env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             start_new_session=True)
    try:
        _wait_for(os.path.join(run, "checkpoints", "step_00000002", "COMPLETE.json"), first)
        second = subprocess.run(_cmd(run, 1, "--no-compile", "--steps", 30, "--precision", "no"), env=_env(),
                                capture_output=True, text=True, timeout=120)
        assert first.poll() is None, "the first run ended before the second was started"
        hold.touch()
        out, _ = first.communicate(timeout=240)
    finally:
        _kill(first)
    assert second.returncode != 0
    assert f"{run} is in use by process {first.pid}" in second.stderr, second.stderr[-2000:]
    assert "resumed from" not in second.stdout
    assert first.returncode == 0, out[-3000:]
    mgr = ft.CheckpointManager(run / "checkpoints")
    assert mgr.steps() == list(range(2, 31, 2))
    assert T.tree_equal(ft.load(mgr.path(30)), ft.load(ft.CheckpointManager(ref / "checkpoints").path(30)))


def test_a_too_small_dataset_gets_advice_a_trainer_user_can_follow(tmp_path):
    """The Trainer always drops an incomplete last batch: "use drop_last=False" is advice its users cannot take."""
    with pytest.raises(ValueError) as e:
        ft.Trainer(Linear(), _data(n=12), _config(tmp_path, train_batch_size=8, gradient_accumulate_every=2))
    message = str(e.value)
    assert "drop_last=False" not in message, message
    assert "TrainConfig.train_batch_size (now 8)" in message and "gradient_accumulate_every (now 2" in message
    assert "fewer processes (now 1)" in message and "add data" in message, message


def test_two_sharded_runs_on_one_folder_blame_rank_0_whose_lock_failed(tmp_path):
    """The second 2-process run fails: rank 0 cannot take the lock (its own error, naming the holder); rank 1
    only follows it (PeerFailed, a secondary failure), so the launcher's summary blames rank 0."""
    args = ("--no-compile", "--save-every", 2, "--shard", "optimizer", "--precision", "no")
    first = subprocess.Popen(_cmd(tmp_path, 2, "--steps", 100000, "--step-sleep", 0.1, *args), env=_env(),
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        _wait_for(os.path.join(tmp_path, "checkpoints", "step_00000002", "SHARDED.json"), first)  # it runs
        started = time.monotonic()
        second = subprocess.run(_cmd(tmp_path, 2, "--steps", 100000, *args), env=_env(), capture_output=True,
                                text=True, timeout=180)
        took = time.monotonic() - started
        assert first.poll() is None, "the first run ended before the second was started"
    finally:
        _kill(first)
    assert second.returncode != 0
    summary = [ln for ln in second.stderr.splitlines() if "failed first:" in ln]
    assert summary and re.search(r"rank 0 \(local rank 0, pid \d+\) failed first: FolderLocked: .* is in use by "
                                 r"process \d+", summary[-1]), (took, second.stderr[-3000:])
    # rank 1 only echoed rank 0's failure: a secondary one (stopped by the launcher, or PeerFailed), never an
    # error of its own that could be blamed
    others = [ln for ln in second.stderr.splitlines() if ln.strip().startswith("other ranks stopped: 1 (")]
    assert others and ("SIGTERM" in others[-1] or "PeerFailed" in others[-1]), second.stderr[-3000:]
