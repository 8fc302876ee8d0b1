"""ft.Trainer: bit-exact resume after SIGKILL (1 and 2 processes), SIGTERM, trackers, samples, config checks.

Every subprocess runs with a timeout; runs share the inductor cache, so only the first compiles cold.
The compiled runs are reproducible ones (``--switch-at``, ``TrainConfig.compile_switch_at``): the
background compile takes over at a fixed step (6 of 12), so resumes before and after it both replay it.
"""
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

import functrain as ft
from functrain import tree as T

JOB = os.path.join(os.path.dirname(__file__), "trainer_job.py")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _cmd(results, nproc=1, *args):
    job = [JOB, str(results), *map(str, args)]
    if nproc == 1:
        return [sys.executable, *job]
    return [sys.executable, "-m", "functrain.launch", "--nproc", str(nproc), *job]


def _env():
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT, "FUNCTRAIN_DIST_TIMEOUT": "60"}


REPRODUCIBLE = ("--switch-at", 6)  # eager for 6 steps, compiled from step 7 on, whenever the compile is done


def _run(results, nproc=1, *args, timeout=300):
    out = subprocess.run(_cmd(results, nproc, *args), env=_env(), capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out


def _final(results, steps):
    manager = ft.CheckpointManager(os.path.join(results, "checkpoints"))
    assert manager.latest() is not None and manager.steps()[-1] == steps
    return ft.load(manager.path(steps))


def _kill_after_checkpoint(results, nproc, step, args=(), sig=signal.SIGKILL):
    """Start the job, wait for checkpoint `step`, then send `sig` to the whole job."""
    proc = subprocess.Popen(_cmd(results, nproc, *args), env=_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    target = os.path.join(results, "checkpoints", f"step_{step:08d}", "COMPLETE.json")
    deadline = time.monotonic() + 240
    try:
        while not os.path.exists(target):
            assert proc.poll() is None, f"job ended before step {step}:\n{proc.stdout.read()[-3000:]}"
            assert time.monotonic() < deadline, "no checkpoint in time"
            time.sleep(0.05)
        if sig == signal.SIGTERM:
            proc.send_signal(sig) if nproc == 1 else os.killpg(proc.pid, sig)
            out, _ = proc.communicate(timeout=120)
            return proc.returncode, out
        os.killpg(proc.pid, sig)
        out, _ = proc.communicate(timeout=60)
        return proc.returncode, out
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)


def _drop_after(results, step):
    """Forget checkpoints after `step`, as if the kill had come right after it."""
    folder = os.path.join(results, "checkpoints")
    for name in os.listdir(folder):
        if name.startswith("step_") and int(name[5:]) > step:
            shutil.rmtree(os.path.join(folder, name))


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted 12-step run, one process."""
    results = tmp_path_factory.mktemp("ref")
    _run(results, 1, *REPRODUCIBLE, timeout=900)  # (the first, cold compile)
    return results, _final(results, 12)


@pytest.mark.parametrize("resume_at", [4, 9])  # 4.5 updates per epoch: 9 is an epoch boundary, 4 mid-epoch
def test_resume_after_sigkill_is_bit_exact(tmp_path, reference, resume_at):
    ref_results, expected = reference
    code, out = _kill_after_checkpoint(tmp_path, 1, resume_at, args=("--save-every", 1, *REPRODUCIBLE))
    assert code == -signal.SIGKILL, out[-2000:]
    _drop_after(tmp_path, resume_at)
    out = _run(tmp_path, 1, "--save-every", 1, *REPRODUCIBLE)
    assert "resumed from" in out.stdout and f"at step {resume_at}" in out.stdout, out.stdout[-2000:]
    got = _final(tmp_path, 12)
    assert T.tree_equal(got, expected), "the resumed run differs from the uninterrupted one"
    # the same samples in the same order: every logged loss after the resume point is identical
    ref_log = [json.loads(line) for line in open(os.path.join(ref_results, "metrics.jsonl"))]
    log = [json.loads(line) for line in open(os.path.join(tmp_path, "metrics.jsonl"))]
    assert [r["step"] for r in log] == list(range(1, 13))
    assert [r["loss"] for r in log] == [r["loss"] for r in ref_log]


def test_resume_two_processes_and_change_of_world(tmp_path, reference):
    ref_results, expected = reference
    # two processes, each half the batch of the one-process run: the same updates (fp16: same micro-batches)
    code, out = _kill_after_checkpoint(tmp_path, 2, 5, args=("--save-every", 1, *REPRODUCIBLE))
    assert code != 0
    _drop_after(tmp_path, 5)
    _run(tmp_path, 2, "--save-every", 1, *REPRODUCIBLE)
    two = _final(tmp_path, 12)
    assert int(two.step) == 12
    uninterrupted = tmp_path / "uninterrupted"
    _run(uninterrupted, 2, *REPRODUCIBLE)
    assert T.tree_equal(two, _final(uninterrupted, 12)), "2-process resume is not bit-exact"
    # the state is replicated, so a 2-process checkpoint resumes on 1 process, from the same global sample
    one = tmp_path / "one"
    shutil.copytree(uninterrupted / "checkpoints" / "step_00000002", one / "checkpoints" / "step_00000002")
    _run(one, 1, "--steps", 3, "--no-compile")
    data = ft.load_extra(ft.CheckpointManager(one / "checkpoints").path(3))["data"]
    # 2 updates of 2 ranks x 8 samples into epoch 0, then one update of 1 x 8
    assert (data["epoch"], data["samples"]) == (0, 2 * 16 + 8), data


def test_sigterm_saves_and_exits_cleanly(tmp_path, reference):
    _, expected = reference
    code, out = _kill_after_checkpoint(tmp_path, 1, 2, args=("--slow", 0.3, *REPRODUCIBLE), sig=signal.SIGTERM)
    assert code == 0, out[-2000:]
    steps = ft.CheckpointManager(os.path.join(tmp_path, "checkpoints")).steps()
    assert steps and steps[-1] < 12  # it stopped early, with a checkpoint of the step it was on
    _run(tmp_path, 1, *REPRODUCIBLE)
    assert T.tree_equal(_final(tmp_path, 12), expected)


def test_outputs_jsonl_samples_curve_tensorboard(tmp_path):
    pytest.importorskip("tensorboard")
    _run(tmp_path, 1, "--steps", 4, "--precision", "no", "--trackers", "jsonl,tensorboard", "--no-compile")
    log = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert [r["step"] for r in log] == [1, 2, 3, 4]
    assert {"loss", "grad_norm", "lr", "steps_per_s"} <= set(log[0])
    assert all(np.isfinite(r["loss"]) for r in log)
    # num_samples=4 -> a 2 x 2 grid of 4x6 images enlarged 4x, 1 px of padding, under a "step 2" caption
    from test_config import _read_png
    from functrain.trainer.images import text_bitmap

    image = _read_png(tmp_path / "sample-2.png")
    h, w = 2 * (4 * 4 + 1) + 1, 2 * (6 * 4 + 1) + 1
    glyphs = text_bitmap("step 2", scale=3)
    strip, width = glyphs.shape[0] + 6, max(w, glyphs.shape[1] + 6)
    assert image.shape == (strip + h, width)
    x = (width - w) // 2
    grid = image[strip:, x:x + w]
    assert grid.shape == (h, w) and (grid[0] == 0).all()  # the grid (black padding rows) below the caption
    gx = (width - glyphs.shape[1]) // 2
    assert ((image[3:3 + glyphs.shape[0], gx:gx + glyphs.shape[1]] == 0) == glyphs).all()  # the caption reads
    # the metrics plot (loss.png's successor): a PNG with matplotlib, else a labelled SVG
    try:
        import matplotlib  # noqa: F401
        from PIL import Image
    except ImportError:
        assert ">step<" in (tmp_path / "metrics.svg").read_text()
    else:
        plot = np.asarray(Image.open(tmp_path / "metrics.png").convert("RGB"))
        assert plot.shape[0] >= 300 and (plot < 80).any() and (plot > 250).mean() > 0.5
    saved = ft.TrainConfig.load(tmp_path / "config.json")
    assert saved.train_num_steps == 4 and saved.mixed_precision == "no"
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    events = acc.Scalars("loss")
    assert [e.step for e in events] == [1, 2, 3, 4]
    assert np.allclose([e.value for e in events], [r["loss"] for r in log], rtol=1e-6)


def test_structural_config_change_is_refused(tmp_path):
    _run(tmp_path, 1, "--steps", 2, "--precision", "fp16", "--no-compile")
    out = subprocess.run(_cmd(tmp_path, 1, "--steps", 4, "--precision", "no", "--no-compile"), env=_env(),
                         capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "mixed_precision" in out.stderr and "structure" in out.stderr


def test_trainer_rejects_bad_arguments():
    with pytest.raises(TypeError, match="TrainConfig"):
        ft.Trainer(torch.nn.Linear(2, 1), [], {"train_lr": 1})
    with pytest.raises(TypeError, match="params="):
        ft.Trainer(lambda p, b, x: x, [], ft.TrainConfig())


def test_sigterm_on_two_processes_saves_the_same_step(tmp_path):
    """SIGTERM to the whole job (what a scheduler sends): both ranks finish a step, agree, save once, exit 0."""
    code, out = _kill_after_checkpoint(tmp_path, 2, 2, args=("--slow", 0.3, "--no-compile", "--steps", 40),
                                       sig=signal.SIGTERM)
    done = re.findall(r"DONE step=(\d+) rank=(\d+)", out)  # (a rank's line may follow a progress bar's)
    assert sorted(rank for _, rank in done) == ["0", "1"], out[-3000:]  # both ranks returned normally ...
    steps = {step for step, _ in done}
    assert len(steps) == 1, done  # ... at the same step ...
    step = int(steps.pop())
    assert step < 40
    assert ft.CheckpointManager(os.path.join(tmp_path, "checkpoints")).steps()[-1] == step  # ... with it saved
    assert code == 128 + signal.SIGTERM  # the launcher itself reports that it was stopped


def _compile_workers_of(pid):
    """Compile workers started by process ``pid`` that are still alive (their command line names ``pid``)."""
    found = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
            with open(f"/proc/{entry}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    continue
        except OSError:
            continue
        if b"functrain.compiler.worker" in argv and str(pid).encode() in argv:
            found.append(int(entry))
    return found


def test_sigterm_while_compiling_in_the_background_saves_at_once(tmp_path):
    """A cold compile runs in its worker when SIGTERM comes: the trainer saves the step it is on and exits
    within seconds (the launcher's grace period is 30 s); the worker does not hold it up and does not outlive it."""
    # cold: the compile takes long; FUNCTRAIN_COMPILE_FINISH=1 (the default outside the suite): a run that ends
    # normally would let its worker finish, one stopped by SIGTERM must not
    env = {**_env(), "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor"), "FUNCTRAIN_COMPILE_FINISH": "1"}
    proc = subprocess.Popen(_cmd(tmp_path / "run", 1, "--steps", 100000, "--save-every", 2, "--precision", "no"),
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    target = tmp_path / "run" / "checkpoints" / "step_00000002" / "COMPLETE.json"
    try:
        deadline = time.monotonic() + 240
        while not (target.exists() and _compile_workers_of(proc.pid)):
            assert proc.poll() is None and time.monotonic() < deadline, "no checkpoint / worker in time"
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        sent = time.monotonic()
        out, _ = proc.communicate(timeout=60)
        took = time.monotonic() - sent
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
    assert proc.returncode == 0, out[-3000:]
    assert took < 30, f"{took:.1f} s from SIGTERM to exit"
    done = re.findall(r"DONE step=(\d+)", out)
    assert done and ft.CheckpointManager(tmp_path / "run" / "checkpoints").steps()[-1] == int(done[0])
    deadline = time.monotonic() + 15
    while _compile_workers_of(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _compile_workers_of(proc.pid), "the compile worker outlived the trainer"
