"""The launchers start no code from the current folder: a package planted there by another user never runs.

The attack: a job is started from a folder another uid can write (``/tmp``, a shared project folder); that uid
plants ``functrain/`` (or ``torch/``, ``multiprocessing/``) there. ``python -m`` and ``python -c`` put the current
folder first on ``sys.path``, so a rank started that way would import the planted package, as the user. Here
another uid (65534, through ``setpriv``) plants packages that leave a marker file, then the user (root, the test)
runs a job with that folder as its current folder: the markers must not appear and the job must succeed.
"""
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap

import pytest

OTHER = 65534  # nobody
PLANTED = ("functrain", "torch", "multiprocessing")

pytestmark = [
    pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0,
                       reason="planting a package as another uid needs root (setpriv --reuid)"),
    pytest.mark.skipif(shutil.which("setpriv") is None, reason="setpriv (util-linux) is not installed"),
]


def _env():
    env = dict(os.environ)
    for var in ("FUNCTRAIN_DIST_TIMEOUT", "OMP_NUM_THREADS", "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                "MASTER_PORT", "TORCHELASTIC_ERROR_FILE", "FUNCTRAIN_LAUNCHER_PID", "PYTHONPATH", "PYTHONSAFEPATH"):
        env.pop(var, None)
    env["OMP_NUM_THREADS"] = "1"
    return env


@pytest.fixture
def shared():
    """A world-writable sticky folder (like /tmp) in which uid 65534 planted packages that leave markers."""
    folder = tempfile.mkdtemp(prefix="functrain-shared-")  # under /tmp: uid 65534 can reach it
    os.chmod(folder, 0o1777)
    marks = tempfile.mkdtemp(prefix="functrain-marks-")
    os.chmod(marks, 0o1777)
    plant = "; ".join(
        f"mkdir {name} && printf '%s\\n' "
        f"\"open('{marks}/{name}', 'w').write('run as uid %d' % __import__('os').getuid())\" "
        f"\"raise RuntimeError('the planted {name} package ran')\" > {name}/__init__.py"
        for name in PLANTED)
    subprocess.run(["setpriv", "--reuid", str(OTHER), "--regid", str(OTHER), "--clear-groups", "sh", "-c", plant],
                   cwd=folder, check=True, timeout=30)
    for name in PLANTED:
        assert os.stat(os.path.join(folder, name, "__init__.py")).st_uid == OTHER
    try:
        yield folder, marks
    finally:
        shutil.rmtree(folder, ignore_errors=True)
        shutil.rmtree(marks, ignore_errors=True)


def _launcher() -> list:
    """The launcher as a user starts it without the current folder on its own path: the console script
    (``python -m functrain.launch`` itself imports from the current folder: docs/distributed.md)."""
    script = os.path.join(os.path.dirname(sys.executable), "functrain-launch")
    if os.path.isfile(script):
        return [script]
    if sys.version_info >= (3, 11):
        return [sys.executable, "-P", "-m", "functrain.launch"]
    return [sys.executable, "-c", "import sys; del sys.path[0]; from functrain.distributed.cli import main; "
                                  "sys.exit(main())"]


SCRIPT = textwrap.dedent("""
    import sys, torch, functrain
    print("ok", functrain.__file__, torch.__file__, flush=True)
""")


def _check(p, marks, expected_ok: int):
    out = p.stdout + p.stderr
    ran = {name: open(os.path.join(marks, name)).read() for name in os.listdir(marks)}
    assert not ran, f"planted packages ran: {ran}\n{out[-3000:]}"
    assert p.returncode == 0, out[-3000:]
    import functrain

    real = os.path.abspath(functrain.__file__)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("ok ")]
    assert len(lines) == expected_ok, out[-3000:]
    assert all(ln.split()[1] == real for ln in lines), lines


def test_the_cli_launcher_starts_no_code_from_the_current_folder(shared, tmp_path):
    folder, marks = shared
    script = tmp_path / "job.py"  # the user's own script, in a folder of the user's
    script.write_text(SCRIPT)
    p = subprocess.run([*_launcher(), "--nproc", "2", str(script)], cwd=folder, env=_env(), capture_output=True,
                       text=True, timeout=240)
    _check(p, marks, 2)


def test_the_cli_launcher_keeps_python_m_semantics_for_the_users_module(shared):
    """``-m mypkg.train``: the current folder is on the module's path (like ``python -m``), added only after
    functrain and torch were imported from where the launcher has them."""
    folder, marks = shared
    with open(os.path.join(folder, "userjob.py"), "w") as f:  # the user's module, in the current folder
        f.write(SCRIPT)
    p = subprocess.run([*_launcher(), "--nproc", "1", "-m", "userjob"], cwd=folder, env=_env(), capture_output=True,
                       text=True, timeout=240)
    _check(p, marks, 1)


LAUNCH = textwrap.dedent("""
    import functrain as ft

    def work():
        import functrain, torch
        return functrain.__file__

    if __name__ == "__main__":
        for path in ft.launch(work, nprocs=2, timeout=200):
            print("ok", path, flush=True)
""")


@pytest.mark.skipif(sys.version_info < (3, 11), reason="multiprocessing's spawn starts each process with "
                                                       "`python -c`, which on Python 3.10 imports its own "
                                                       "module from the current folder first (no -P there)")
def test_ft_launch_starts_no_code_from_the_current_folder(shared, tmp_path):
    folder, marks = shared
    script = tmp_path / "launch_job.py"
    script.write_text(LAUNCH)
    p = subprocess.run([sys.executable, str(script)], cwd=folder, env=_env(), capture_output=True, text=True,
                       timeout=240)
    _check(p, marks, 2)
