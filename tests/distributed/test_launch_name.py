"""``ft.launch`` stays callable as the in-process launcher whoever imports ``functrain.launch`` (the ``python -m``
entry point): a user, a doctest or documentation run over the package, ``pkgutil.walk_packages``; and
``sys.modules`` holds modules only (``functrain.launch`` is a callable module, with its ``__file__``). Each check runs in
a fresh interpreter (with a timeout), so that no earlier import in this process hides the binding."""
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_WALK = r"""
import importlib, pkgutil, sys
import functrain as ft
import functrain.launch
import functrain.distributed
assert callable(ft.launch), f"after import functrain.launch, ft.launch is {ft.launch!r}"
names, skipped = [], []
for info in pkgutil.walk_packages(ft.__path__, "functrain.", onerror=skipped.append):
    try:
        importlib.import_module(info.name)
    except ImportError as e:  # an optional extra that is not installed here
        skipped.append(f"{info.name}: {e}")
    names.append(info.name)
assert "functrain.launch" in names, names
from functrain import launch as imported
import types
not_modules = sorted(k for k, v in list(sys.modules.items()) if k.startswith("functrain")
                     and not isinstance(v, types.ModuleType))
mod = sys.modules["functrain.launch"]
print("CALLABLE", callable(ft.launch), "MODULE", isinstance(mod, types.ModuleType) and mod.__file__.endswith("launch.py"),
      "BOUND", ft.launch is mod and imported is mod,
      "IMPORT_MODULE", importlib.import_module("functrain.launch") is mod,
      "NOT_MODULES", not_modules,
      "SIGNATURE", next(iter(__import__("inspect").signature(ft.launch).parameters)), flush=True)
print("MODULES", len(names), "SKIPPED", skipped, flush=True)
"""


def _env():
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}


def test_importing_every_module_keeps_ft_launch_the_function():
    out = subprocess.run([sys.executable, "-c", _WALK], capture_output=True, text=True, timeout=300, env=_env(),
                         cwd=ROOT)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "CALLABLE True MODULE True BOUND True IMPORT_MODULE True NOT_MODULES [] SIGNATURE fn" in out.stdout, \
        out.stdout


def test_the_callable_module_launches_two_ranks(tmp_path):
    """``ft.launch`` after ``import functrain.launch`` (now the module) runs a function on two real ranks."""
    script = tmp_path / "two_ranks.py"
    script.write_text("import types\n"
                      "import torch.distributed as dist\n"
                      "import functrain as ft\n"
                      "import functrain.launch\n"
                      "def fn(x):\n"
                      "    return dist.get_rank() * 10 + x\n"
                      "if __name__ == '__main__':\n"
                      "    assert isinstance(ft.launch, types.ModuleType), ft.launch\n"
                      "    print('RESULTS', ft.launch(fn, nprocs=2, args=(1,), timeout=120), flush=True)\n")
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, env=_env(),
                         cwd=ROOT)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "RESULTS [1, 11]" in out.stdout, out.stdout


def test_python_m_functrain_launch_is_still_the_command_line_launcher():
    out = subprocess.run([sys.executable, "-m", "functrain.launch", "--help"], capture_output=True, text=True,
                         timeout=120, env=_env(), cwd=ROOT)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert out.stdout.startswith("usage: python -m functrain.launch") and "--nproc" in out.stdout, out.stdout
