"""The compile worker keeps its promises: no code from the current folder, settings checked once, no leaked files.

* A script run from a folder another user can write (``/tmp``, a shared project folder) where that user planted a
  ``functrain`` package: the background compile worker imports functrain from where the training process did,
  never from the current folder (tested as the attacker acts: the package is written by another uid, through
  ``setpriv``, into a world-writable sticky folder).
* Every ``FUNCTRAIN_COMPILE_*`` variable is checked when ``ft.compile`` is called: a bad value names the variable,
  the value and what is allowed; every bound is finite.
* A background compile leaves no file open for the garbage collector (``ResourceWarning``).
"""
import os
import shutil
import subprocess
import sys
import tempfile

import pytest

import functrain as ft
from functrain.compiler.settings import SETTINGS, BadSetting, WorkerSettings

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))

# a background compile, run to the switch (a tiny step: the worker compiles it in seconds); prints the phase
_SCRIPT = """
import warnings, time, torch, functrain as ft
warnings.simplefilter("always")
step = ft.train_step(lambda p, b, x: ((p["w"] * x).tanh().sum() - 1) ** 2, ft.optim.adamw(0.1))
state = step.init({"w": torch.ones(64)})
c = ft.compile(step, background=True)
deadline = time.monotonic() + 600
while c.progress is None or c.progress.phase not in ("compiled", "failed"):
    state, _ = c(state, torch.ones(64))
    assert time.monotonic() < deadline, c.progress
print("PHASE", c.progress.phase, c.progress.reason, flush=True)
"""


def _run_script(tmp_path, cwd, cache, extra_env=None, python_flags=()):
    script = tmp_path / "train.py"  # the user's own script, in a folder of theirs; run from `cwd`
    script.write_text(_SCRIPT)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT, "TORCHINDUCTOR_CACHE_DIR": str(cache),
           "FUNCTRAIN_COMPILE_FINISH": "0", **(extra_env or {})}
    return subprocess.run([sys.executable, *python_flags, str(script)], cwd=str(cwd), env=env, capture_output=True,
                          text=True, timeout=900)


@pytest.mark.skipif(shutil.which("setpriv") is None or os.geteuid() != 0,
                    reason="needs setpriv and root, to act as another uid")
def test_a_package_planted_in_the_current_folder_by_another_user_never_runs(tmp_path):
    """Row 1 of "Promises kept": before the fix the worker was started as ``python -m functrain.compiler.worker``,
    which put the current folder first on ``sys.path``: the planted package ran as the user."""
    shared = tempfile.mkdtemp(prefix="functrain-shared-", dir="/tmp")  # a folder every user can write
    try:
        os.chmod(shared, 0o1777)
        marker = os.path.join(shared, "PLANTED-CODE-RAN")
        payload = f"open({marker!r}, 'w').write(str(__import__('os').getuid()))\nraise SystemExit('planted')\n"
        plant = ("import os\n"
                 "os.makedirs('functrain', exist_ok=True)\n"
                 f"open('functrain/__init__.py', 'w').write({payload!r})\n")
        # the attacker: uid 65534 (owns nothing here), writing into the shared folder
        subprocess.run(["setpriv", "--reuid", "65534", "--regid", "65534", "--clear-groups", sys.executable, "-c",
                        plant], cwd=shared, check=True, timeout=60, env={"PATH": os.environ.get("PATH", "")})
        assert os.stat(os.path.join(shared, "functrain", "__init__.py")).st_uid == 65534
        out = _run_script(tmp_path, shared, tmp_path / "cache")
        assert not os.path.exists(marker), "the planted package ran as the user: " + out.stderr[-2000:]
        assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
        assert "PHASE compiled None" in out.stdout, out.stdout[-2000:] + out.stderr[-3000:]
    finally:
        shutil.rmtree(shared, ignore_errors=True)


def test_a_background_compile_leaks_no_file(tmp_path):
    """Row 11: with every warning shown, a background compile (its worker, the spare worker it closes, its pipes
    and log) leaves nothing to the garbage collector: no ``ResourceWarning``."""
    out = _run_script(tmp_path, tmp_path, tmp_path / "cache", python_flags=("-X", "dev", "-W", "always"))
    assert out.returncode == 0 and "PHASE compiled None" in out.stdout, out.stdout[-2000:] + out.stderr[-3000:]
    assert "ResourceWarning" not in out.stderr, out.stderr[-3000:]


@pytest.mark.parametrize("variable, bad, allowed", [
    ("FUNCTRAIN_COMPILE_TIMEOUT", "inf", "a number of seconds > 0"),
    ("FUNCTRAIN_COMPILE_TIMEOUT", "0", "a number of seconds > 0"),
    ("FUNCTRAIN_COMPILE_TIMEOUT", "1e9", "a number of seconds > 0"),
    ("FUNCTRAIN_COMPILE_NICE", "abc", "an integer from 0 to 19"),
    ("FUNCTRAIN_COMPILE_NICE", "-5", "an integer from 0 to 19"),
    ("FUNCTRAIN_COMPILE_NICE", "20", "an integer from 0 to 19"),
    ("FUNCTRAIN_COMPILE_LOCK_TIMEOUT", "-3", "a number of seconds >= 0"),
    ("FUNCTRAIN_COMPILE_LOCK_TIMEOUT", "inf", "a number of seconds >= 0"),
    ("FUNCTRAIN_COMPILE_LOCK_TIMEOUT", "nan", "a number of seconds >= 0"),
    ("FUNCTRAIN_COMPILE_FOLLOW_S", "-1", "a number of seconds >= 0"),
    ("FUNCTRAIN_COMPILE_FINISH", "2", "0 (a compile still running at exit is killed) or 1"),
    ("FUNCTRAIN_COMPILE_WORKER", "fork", "'process' or 'thread'"),
])
@pytest.mark.parametrize("background", [True, False])
def test_every_setting_is_checked_when_ft_compile_is_called(monkeypatch, variable, bad, allowed, background):
    """Row 8: each bad value is refused by ``ft.compile`` itself, in either mode (the lock timeout and the finish
    flag were checked only on some paths, or at exit; a non-numeric niceness was ignored in silence; ``inf``
    overflowed the worker's timer)."""
    step = ft.train_step(lambda p, b, x: (p["w"] * x).sum(), ft.optim.sgd(0.1))
    monkeypatch.setenv(variable, bad)
    with pytest.raises(BadSetting) as e:
        ft.compile(step, background=background)
    assert str(e.value).startswith(f"{variable} must be {allowed}") and repr(bad) in str(e.value)
    assert isinstance(e.value, ValueError)


def test_the_settings_table_covers_every_field_with_finite_bounds():
    """One table reads every variable; its defaults are the dataclass's; the bounds admit their edges."""
    fields = {f.name for f in WorkerSettings.__dataclass_fields__.values()}
    assert {s.field for s in SETTINGS} == fields
    assert len({s.variable for s in SETTINGS}) == len(SETTINGS)
    ok = WorkerSettings.from_env({"FUNCTRAIN_COMPILE_TIMEOUT": "604800", "FUNCTRAIN_COMPILE_NICE": " 0 ",
                                  "FUNCTRAIN_COMPILE_LOCK_TIMEOUT": "0", "FUNCTRAIN_COMPILE_FOLLOW_S": "3600",
                                  "FUNCTRAIN_COMPILE_FINISH": "0", "FUNCTRAIN_COMPILE_WORKER": "thread"})
    assert ok == WorkerSettings(worker="thread", timeout=604800.0, nice=0, lock_timeout=0.0, follow_s=3600.0,
                                finish=False)
    assert WorkerSettings.from_env({}) == WorkerSettings()


def _reads_of_compile_variables(source: str) -> list:
    """Where ``source`` reads a ``FUNCTRAIN_COMPILE_*`` variable from the environment (``os.environ.get(X)``,
    ``os.environ[X]``, ``os.getenv(X)``, ``env_seconds(X, ...)``; ``X`` a string or a module constant holding one)."""
    import ast

    tree = ast.parse(source)
    names = {t.id for node in tree.body if isinstance(node, ast.Assign) for t in node.targets
             if isinstance(t, ast.Name) and isinstance(node.value, ast.Constant)
             and str(node.value.value).startswith("FUNCTRAIN_COMPILE_")}

    def is_variable(x) -> bool:
        return (isinstance(x, ast.Constant) and str(x.value).startswith("FUNCTRAIN_COMPILE_")) or \
            (isinstance(x, ast.Name) and x.id in names)

    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and node.args and is_variable(node.args[0]):
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")
            if name in ("get", "getenv", "env_seconds", "pop", "setdefault"):
                found.append(node.lineno)
        if isinstance(node, ast.Subscript) and is_variable(node.slice):
            found.append(node.lineno)
    return found


def test_no_module_below_ft_compile_reads_a_compile_variable():
    """The settings are read in one place (compiler/settings.py, through its table) and handed down."""
    import pathlib

    package = pathlib.Path(ft.__file__).parent
    reads = {str(path.relative_to(package)): lines for path in sorted(package.rglob("*.py"))
             if (lines := _reads_of_compile_variables(path.read_text()))}
    assert reads == {}, reads
    planted = "import os\nNICE = 'FUNCTRAIN_COMPILE_NICE'\nn = int(os.environ.get(NICE, '10'))\n"
    assert _reads_of_compile_variables(planted) == [3]  # the check sees a read through a constant
