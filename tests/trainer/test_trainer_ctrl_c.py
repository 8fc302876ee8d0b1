"""Ctrl-C (SIGINT) saves, as SIGTERM does: on one process, on two ranks under `python -m functrain.launch` and
under `ft.launch` (the notebook launcher).

A terminal's Ctrl-C goes to the whole foreground process group (here: `os.killpg` of a job started in a session of
its own); `kill -INT <launcher>` reaches only the launcher, which forwards it. Either way every rank stops at an
agreed step and saves; the launcher's exit status and last line say whether the checkpoint is written. A second
Ctrl-C within the grace period stops at once and says what is lost. No traceback from inside a step.

Real processes (2 ranks over gloo, OMP_NUM_THREADS=1), each with a timeout; the tests wait for what the job
reports (a checkpoint's mark, a metrics line, a printed line), never a fixed sleep.
"""
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

import functrain as ft
from functrain import tree as T

pytest.importorskip("safetensors")

HERE = os.path.dirname(os.path.abspath(__file__))
JOB = os.path.join(HERE, "trainer_job.py")
ROOT = os.path.dirname(os.path.dirname(HERE))


def _env(**extra):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                            "MASTER_PORT", "FUNCTRAIN_STOP_REPORT",
                                                            "FUNCTRAIN_LAUNCHER_PID", "TORCHELASTIC_ERROR_FILE")}
    return {**env, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT, "FUNCTRAIN_DIST_TIMEOUT": "60", **extra}


def _cmd(results, nproc, *args):
    job = [JOB, str(results), *map(str, args)]
    return [sys.executable, *job] if nproc == 1 else [sys.executable, "-m", "functrain.launch", "--nproc",
                                                      str(nproc), *job]


class Job:
    """A job in a session of its own whose output (stdout and stderr) is read as it comes."""

    def __init__(self, argv, **kw):
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     start_new_session=True, **kw)
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self):
        for line in self.proc.stdout:
            self.lines.extend(re.split(r"[\r\n]", line))

    @property
    def out(self) -> str:
        return "\n".join(self.lines)

    def wait_for(self, what, timeout=240.0):
        """Wait until ``what()`` is true (a file, a line), failing early if the job ends."""
        deadline = time.monotonic() + timeout
        while not what():
            assert self.proc.poll() is None, f"the job ended early ({self.proc.returncode}):\n{self.out[-3000:]}"
            assert time.monotonic() < deadline, f"not in {timeout:g} s:\n{self.out[-3000:]}"
            time.sleep(0.05)

    def said(self, text):
        return lambda: any(text in line for line in list(self.lines))

    def finish(self, timeout=120.0) -> int:
        try:
            self.proc.wait(timeout=timeout)
        finally:
            if self.proc.poll() is None:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=30)
        self._reader.join(timeout=30)
        return self.proc.returncode

    def last_line(self) -> str:
        return next((ln for ln in reversed(self.lines) if ln.strip()), "")


def _checkpoint(results, step):
    return lambda: os.path.exists(os.path.join(results, "checkpoints", f"step_{step:08d}", "COMPLETE.json"))


def _logged(results, step):
    def done():
        try:
            with open(os.path.join(results, "metrics.jsonl")) as f:
                return any(json.loads(ln).get("step") == step for ln in f if ln.endswith("\n"))
        except (OSError, ValueError):
            return False
    return done


def _no_traceback(out):
    assert "Traceback" not in out and "KeyboardInterrupt" not in out, out[-3000:]


# ------------------------------------------------------------------------------------------ one process

def test_ctrl_c_saves_on_one_process_and_the_resume_equals_an_uninterrupted_run(tmp_path):
    """Ctrl-C to the process group (a terminal's Ctrl-C): the step in flight finishes, it is saved, the run says
    so and ends normally; running it again resumes to the same state as a run never interrupted."""
    args = ("--no-compile", "--steps", 40, "--save-every", 5, "--precision", "no")
    run = tmp_path / "run"
    job = Job(_cmd(run, 1, *args, "--step-sleep", 0.1), env=_env())
    job.wait_for(_checkpoint(run, 5))
    os.killpg(job.proc.pid, signal.SIGINT)
    code = job.finish()
    out = job.out
    _no_traceback(out)
    assert code == 0, out[-3000:]
    done = re.findall(r"DONE step=(\d+) rank=0", out)
    assert len(done) == 1, out[-3000:]
    step = int(done[0])
    assert 5 <= step < 40, out[-3000:]
    assert ft.CheckpointManager(run / "checkpoints").steps()[-1] == step
    assert f"stopped by SIGINT at step {step} and saved it" in out, out[-3000:]
    assert "Ctrl-C again stops at once without saving" in out, out[-3000:]

    resumed = subprocess.run(_cmd(run, 1, *args), env=_env(), capture_output=True, text=True, timeout=240)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed from {run / 'checkpoints' / f'step_{step:08d}'} at step {step}" in resumed.stdout
    ref = tmp_path / "ref"
    whole = subprocess.run(_cmd(ref, 1, *args), env=_env(), capture_output=True, text=True, timeout=240)
    assert whole.returncode == 0, whole.stderr[-3000:]
    last = lambda folder: ft.load(ft.CheckpointManager(folder / "checkpoints").path(40))  # noqa: E731
    assert T.tree_equal(last(run), last(ref))


def test_a_second_ctrl_c_on_one_process_stops_at_once_and_says_what_is_lost(tmp_path):
    """Steps 1-3 fast, then 4 s steps; checkpoints every 2 steps. Ctrl-C during step 4, then Ctrl-C again while
    the first stop waits for the step: the process ends at once (killed by SIGINT, as an interrupted program),
    its last line says the last checkpoint is step 2 and step 3 is lost."""
    run = tmp_path / "run"
    job = Job(_cmd(run, 1, "--no-compile", "--steps", 1000, "--save-every", 2, "--precision", "no",
                   "--step-sleep", 4, "--slow-after", 3), env=_env())
    job.wait_for(_logged(run, 3))
    os.killpg(job.proc.pid, signal.SIGINT)
    job.wait_for(job.said("Ctrl-C again stops at once"), timeout=30)
    sent = time.monotonic()
    os.killpg(job.proc.pid, signal.SIGINT)
    code = job.finish(timeout=60)
    took = time.monotonic() - sent
    out = job.out
    _no_traceback(out)
    assert code == -signal.SIGINT, out[-3000:]
    assert took < 3.0, f"{took:.1f} s after the second Ctrl-C: not at once (a step takes 4 s)"
    path = run / "checkpoints" / "step_00000002"
    assert job.last_line() == (f"second Ctrl-C: stopped at once without saving (the last finished step: 3); the "
                               f"last checkpoint is step 2 ({path}): step 3 is lost"), out[-3000:]
    assert ft.CheckpointManager(run / "checkpoints").steps() == [2]


# ------------------------------------------------------------------------------------------ two ranks, launcher

@pytest.mark.parametrize("shape", ["launcher", "group"])
def test_ctrl_c_to_the_launcher_saves_every_rank_at_one_step(tmp_path, shape):
    """``kill -INT <launcher>`` (forwarded) or the terminal's Ctrl-C to the launcher's process group: both ranks
    stop at the same step, it is saved, and the launcher exits 130 with a last line naming the checkpoint."""
    job = Job(_cmd(tmp_path, 2, "--no-compile", "--steps", 2000, "--save-every", 5, "--precision", "no",
                   "--step-sleep", 0.1), env=_env())
    job.wait_for(_checkpoint(tmp_path, 5))
    if shape == "launcher":
        job.proc.send_signal(signal.SIGINT)
    else:
        os.killpg(job.proc.pid, signal.SIGINT)
    code = job.finish()
    out = job.out
    _no_traceback(out)
    done = re.findall(r"DONE step=(\d+) rank=(\d+)", out)
    assert sorted(rank for _, rank in done) == ["0", "1"], out[-3000:]
    steps = {int(step) for step, _ in done}
    assert len(steps) == 1, done
    step = steps.pop()
    assert ft.CheckpointManager(tmp_path / "checkpoints").steps()[-1] == step
    assert code == 128 + signal.SIGINT, out[-3000:]
    path = tmp_path / "checkpoints" / f"step_{step:08d}"
    assert job.last_line() == (f"python -m functrain.launch: stopped by SIGINT; every rank ended by itself within "
                               f"--term-timeout 30 s: the checkpoint of step {step} is written ({path}) (exit status "
                               f"130)"), out[-3000:]


def test_a_second_ctrl_c_to_the_launcher_stops_at_once_and_says_what_is_lost(tmp_path):
    job = Job(_cmd(tmp_path, 2, "--no-compile", "--steps", 1000, "--save-every", 2, "--precision", "no",
                   "--step-sleep", 4, "--slow-after", 3), env=_env())
    job.wait_for(_logged(tmp_path, 3))
    job.proc.send_signal(signal.SIGINT)
    job.wait_for(job.said("Ctrl-C again stops at once"), timeout=30)  # (rank 0 got the forwarded signal)
    sent = time.monotonic()
    job.proc.send_signal(signal.SIGINT)
    code = job.finish(timeout=60)
    took = time.monotonic() - sent
    out = job.out
    _no_traceback(out)
    assert code == 128 + signal.SIGKILL, out[-3000:]
    assert took < 3.0 + 5.0, f"{took:.1f} s after the second Ctrl-C"
    path = tmp_path / "checkpoints" / "step_00000002"
    assert job.last_line() == (f"python -m functrain.launch: stopped by SIGINT; a second SIGINT stopped the ranks "
                               f"at once, without waiting for them to save; rank(s) 0, 1 stopped without saving at "
                               f"step 3: the last checkpoint is step 2 ({path}); step 3 is lost (exit status 137)"), \
        out[-3000:]
    assert ft.CheckpointManager(tmp_path / "checkpoints").steps() == [2]


INTERRUPTED = textwrap.dedent("""
    import pathlib, sys, time, torch, functrain as ft
    import torch.distributed as dist

    info = ft.distributed.init()
    t = torch.ones(1)
    dist.all_reduce(t)
    (pathlib.Path(sys.argv[1]) / f"ready{info.rank}").write_text("ok")
    while True:  # a loop of its own, without a Ctrl-C handler: the forwarded SIGINT raises KeyboardInterrupt
        time.sleep(0.05)
""")


def test_a_script_that_does_not_handle_ctrl_c_is_not_reported_as_saved(tmp_path):
    """The launcher said "every rank ended by itself" and exited 130 for ranks that a KeyboardInterrupt ended
    without saving anything; now it says so and exits 137."""
    script = tmp_path / "interrupted.py"
    script.write_text(INTERRUPTED)
    job = Job([sys.executable, "-m", "functrain.launch", "--nproc", "2", str(script), str(tmp_path)], env=_env(),
              cwd=tmp_path)
    job.wait_for(lambda: (tmp_path / "ready0").exists() and (tmp_path / "ready1").exists())
    job.proc.send_signal(signal.SIGINT)
    code = job.finish(timeout=60)
    out = job.out
    assert "Traceback" not in out, out[-3000:]
    assert code == 128 + signal.SIGKILL, out[-3000:]
    assert job.last_line() == ("python -m functrain.launch: stopped by SIGINT; rank(s) 0, 1 ended with "
                               "KeyboardInterrupt (the signal came where the script does not handle it, e.g. before "
                               "ft.Trainer's loop): they saved nothing on the stop: no checkpoint is written (exit "
                               "status 137)"), out[-3000:]


# ------------------------------------------------------------------------------------------ two ranks, ft.launch

LAUNCHED = textwrap.dedent("""
    import sys
    sys.path.insert(0, {here!r})
    import functrain as ft
    import trainer_job

    def work(argv):
        sys.argv = ["trainer_job", *argv]
        trainer_job.main()
        return ft.distributed.rank()

    if __name__ == "__main__":
        try:
            values = ft.launch(work, nprocs=2, args=(sys.argv[1:],), timeout=600, dist_timeout=60)
        except KeyboardInterrupt as e:
            print(f"CALLER KeyboardInterrupt: {{e}}", flush=True)
            sys.exit(3)
        print(f"RETURNED {{values}}", flush=True)
""")


def _launched(tmp_path, *args):
    """A script that runs trainer_job on two ranks with ``ft.launch`` (as a notebook cell does), in a session of its
    own: SIGINT to it is a notebook's interrupt, to its process group a terminal's Ctrl-C."""
    script = tmp_path / "notebook.py"
    script.write_text(LAUNCHED.format(here=HERE))
    return Job([sys.executable, str(script), str(tmp_path / "run"), *map(str, args)], env=_env(), cwd=tmp_path)


@pytest.mark.parametrize("shape", ["caller", "group"])
def test_ctrl_c_under_ft_launch_saves_every_rank_at_one_step(tmp_path, shape):
    """The caller of ``ft.launch`` raised a bare KeyboardInterrupt and killed the ranks: no checkpoint of the stop.
    Now the Ctrl-C is passed on: both ranks stop at the same step and save it, ``launch`` returns their values and
    says which checkpoint is written."""
    run = tmp_path / "run"
    job = _launched(tmp_path, "--no-compile", "--steps", 2000, "--save-every", 5, "--precision", "no",
                    "--step-sleep", 0.1)
    job.wait_for(_checkpoint(run, 5))
    if shape == "caller":
        job.proc.send_signal(signal.SIGINT)
    else:
        os.killpg(job.proc.pid, signal.SIGINT)
    code = job.finish()
    out = job.out
    _no_traceback(out)
    assert code == 0, out[-3000:]
    done = re.findall(r"DONE step=(\d+) rank=(\d+)", out)
    assert sorted(rank for _, rank in done) == ["0", "1"], out[-3000:]
    steps = {int(step) for step, _ in done}
    assert len(steps) == 1, done
    step = steps.pop()
    assert 5 <= step < 2000
    assert ft.CheckpointManager(run / "checkpoints").steps()[-1] == step
    path = run / "checkpoints" / f"step_{step:08d}"
    assert f"ft.launch: stopped by Ctrl-C; every rank saved step {step} ({path}) and returned" in out, out[-3000:]
    assert job.last_line() == "RETURNED [0, 1]", out[-3000:]
    assert out.count("Ctrl-C: stopping after this step") == 1, out[-3000:]  # one signal per rank, not two


def test_a_second_ctrl_c_under_ft_launch_stops_at_once_and_says_what_is_lost(tmp_path):
    run = tmp_path / "run"
    job = _launched(tmp_path, "--no-compile", "--steps", 1000, "--save-every", 2, "--precision", "no",
                    "--step-sleep", 4, "--slow-after", 3)
    job.wait_for(_logged(run, 3))
    job.proc.send_signal(signal.SIGINT)
    job.wait_for(job.said("Ctrl-C: stopping after this step"), timeout=30)  # (rank 0 got the passed-on signal)
    sent = time.monotonic()
    job.proc.send_signal(signal.SIGINT)
    code = job.finish(timeout=60)
    took = time.monotonic() - sent
    out = job.out
    assert "Traceback" not in out, out[-3000:]
    assert code == 3, out[-3000:]
    assert took < 3.0 + 5.0, f"{took:.1f} s after the second Ctrl-C"
    path = run / "checkpoints" / "step_00000002"
    # (the caller's last line: after it, multiprocessing's resource tracker, shared with the ranks, may say it
    # cleaned up the semaphore of a rank that died of the second Ctrl-C, as that rank meant to)
    said = [ln for ln in job.lines if ln.startswith("CALLER")]
    assert said == [f"CALLER KeyboardInterrupt: ft.launch: stopped by Ctrl-C; a second Ctrl-C stopped the ranks at "
                    f"once, without waiting for them to save; rank(s) 0, 1 stopped without saving at step 3: the last "
                    f"checkpoint is step 2 ({path}); step 3 is lost"], out[-3000:]
    assert ft.CheckpointManager(run / "checkpoints").steps() == [2]


PLAIN = textwrap.dedent("""
    import pathlib, sys, time
    import functrain as ft

    def work(folder):
        import torch, torch.distributed as dist
        t = torch.ones(1)
        dist.all_reduce(t)
        pathlib.Path(folder, f"ready{dist.get_rank()}").write_text("ok")
        while True:  # no Ctrl-C handler of its own
            time.sleep(0.05)

    if __name__ == "__main__":
        try:
            ft.launch(work, nprocs=2, args=(sys.argv[1],), timeout=300)
        except KeyboardInterrupt as e:
            print(f"CALLER KeyboardInterrupt: {e}", flush=True)
            sys.exit(3)
""")


def test_ctrl_c_under_ft_launch_of_a_function_without_a_handler_says_nothing_was_saved(tmp_path):
    script = tmp_path / "plain.py"
    script.write_text(PLAIN)
    job = Job([sys.executable, str(script), str(tmp_path)], env=_env(), cwd=tmp_path)
    job.wait_for(lambda: (tmp_path / "ready0").exists() and (tmp_path / "ready1").exists())
    job.proc.send_signal(signal.SIGINT)
    code = job.finish(timeout=60)
    out = job.out
    assert code == 3, out[-3000:]
    assert [ln for ln in job.lines if ln.startswith("CALLER")] == [
        "CALLER KeyboardInterrupt: ft.launch: stopped by Ctrl-C; rank(s) 0, 1 raised KeyboardInterrupt (the Ctrl-C "
        "came where the function does not handle it, e.g. before ft.Trainer's loop): no checkpoint of the stop is "
        "written"], out[-3000:]


# ------------------------------------------------------------------------------------------ the rules, ft.run

def test_the_launchers_verdict():
    from functrain.distributed.faults import lost_steps, stop_outcome

    def rep(saved, how, step, ck):
        return {"saved": saved, "how": how, "step": step, "checkpoint_step": ck, "checkpoint": f"ck/{ck}"}

    saved = {r: rep(True, "saved", 9, 9) for r in (0, 1)}
    code, text = stop_outcome(15, term_timeout=30, after={0: 0, 1: 0}, killed=[], ended=True, second=None,
                              reports=saved)
    assert code == 143 and text.endswith("the checkpoint of step 9 is written (ck/9) (exit status 143)"), text
    # a script that reports nothing and ended by itself: as before (docs/faults.md)
    code, text = stop_outcome(15, term_timeout=30, after={0: 143, 1: 0}, killed=[], ended=True, second=None,
                              reports={})
    assert code == 143 and "every rank ended by itself within --term-timeout 30 s" in text, text
    # saved, then SIGKILLed while exporting: the checkpoint is written
    code, text = stop_outcome(2, term_timeout=5, after={0: -9, 1: 0}, killed=[0], ended=False, second=None,
                              reports=saved)
    assert code == 130 and "every rank saved before it was stopped (rank(s) 0 then SIGKILLed)" in text, text
    # one rank saved, the other was killed mid-save without a report: not written
    code, text = stop_outcome(2, term_timeout=5, after={0: 0, 1: -9}, killed=[1], ended=False, second=None,
                              reports={0: saved[0]})
    assert code == 137 and "rank(s) 1 did not end within --term-timeout 5 s and were SIGKILLed" in text, text
    # a second signal after the stop's save had finished: nothing is lost, the checkpoint is written
    code, text = stop_outcome(2, term_timeout=30, after={0: -2, 1: -2}, killed=[], ended=False, second=2,
                              reports={r: rep(True, "at_once", 9, 9) for r in (0, 1)})
    assert code == 130 and "the checkpoint of step 9 is written" in text, text
    code, text = stop_outcome(2, term_timeout=30, after={0: -2, 1: -9}, killed=[1], ended=False, second=2,
                              reports={0: rep(False, "at_once", 12, 10)})
    assert code == 137 and text.endswith("rank(s) 1 were SIGKILLed: the last checkpoint is step 10 (ck/10); steps "
                                         "11 to 12 are lost (exit status 137)"), text
    assert lost_steps(10, 11) == "step 11 is lost" and lost_steps(10, None) == "no finished step is lost"


RUN = textwrap.dedent("""
    import time, torch, functrain as ft

    def loss(p, b, x):
        time.sleep(0.5)  # a slow step: the Ctrl-C lands inside it
        return (p["w"] - x).pow(2).mean()

    step = ft.train_step(loss, ft.optim.sgd(0.1))

    def data():
        for i in range(100000):
            if i == 3:
                print("READY", flush=True)
            yield torch.ones(2)

    ft.run(step, step.init({"w": torch.zeros(2)}), data(), num_steps=100000, progress=False)
""")


def test_ctrl_c_in_ft_run_raises_from_the_loop_not_from_inside_the_step(tmp_path):
    """ft.run saves nothing: Ctrl-C ends it with a KeyboardInterrupt, raised by the loop after the step in flight
    (the traceback ends in ft.run, not in the loss); the run says so at once."""
    script = tmp_path / "run.py"
    script.write_text(RUN)
    job = Job([sys.executable, str(script)], env=_env())
    job.wait_for(job.said("READY"), timeout=120)
    os.killpg(job.proc.pid, signal.SIGINT)
    code = job.finish(timeout=60)
    out = job.out
    assert code == -signal.SIGINT, out[-3000:]  # (Python ends an uncaught KeyboardInterrupt by the signal)
    assert "Ctrl-C: ft.run stops after this step (Ctrl-C again stops at once)" in out, out[-3000:]
    frames = re.findall(r'File "([^"]+)", line \d+, in (\w+)', out)
    assert frames[-1] == (os.path.join(ROOT, "functrain", "driver.py"), "run"), out[-3000:]
    assert re.search(r"KeyboardInterrupt: Ctrl-C: ft.run stopped after step \d+$", out.strip()), out[-3000:]
