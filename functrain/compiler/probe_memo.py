"""A memo of inductor's CPU probes, so a second compile on this machine does not run them again.

Before its first CPU kernel, inductor compiles a test program per vector ISA the CPU reports and loads each in a
child process (~7 s cold, ~1.3 s with the probes' builds cached: most of a small step's compile). The memo keeps
which probes *passed* in a JSON file in the user's private folder (:func:`functrain.compiler.trust.private_home`),
keyed by the probe's code and flags, the compiler binary (path, size, mtime), the host, the CPU's features and the
torch build. A passed probe is not run again; a failed one always is (a transient failure is not remembered), so
inductor picks the same ISA, and builds the same kernels, as without the memo. No file is unpickled: the memo is
JSON, written atomically (temp file + rename); an unreadable or foreign memo is rebuilt with a warning.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import sys
import tempfile
import warnings
from typing import Any, Iterator

import torch

from . import trust

__all__ = ["probe_memo", "memo_folder", "machine"]

_MEMO_FORMAT = 1


def memo_folder() -> str:
    """Where the probe memo lives: functrain's private folder (:func:`functrain.compiler.trust.private_home`:
    ``FUNCTRAIN_CACHE_DIR``, else ``$XDG_CACHE_HOME/functrain``, else ``~/.cache/functrain``)."""
    return trust.private_home()


def machine() -> dict:
    """This machine and torch build, as compiled code depends on them: host, CPU features, torch, python."""
    import platform
    import socket
    caps = torch.cpu.get_capabilities() if hasattr(torch.cpu, "get_capabilities") else {}
    cuda = None
    if torch.cuda.is_available():
        cuda = [torch.version.cuda, [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
                [torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())]]
    return {"torch": [torch.__version__, getattr(torch.version, "git_version", None), os.path.dirname(torch.__file__)],
            "python": [sys.executable, sys.version], "host": socket.gethostname(), "machine": platform.machine(),
            "cpu": sorted((k, v) for k, v in caps.items() if isinstance(v, (bool, int, str))), "cuda": cuda,
            "env": {k: os.environ.get(k) for k in ("LD_LIBRARY_PATH", "ATEN_CPU_CAPABILITY")}}


def _machine() -> dict:
    """What a probe's outcome depends on besides its code and flags: the machine and the compiler."""
    import shutil
    from torch._inductor.cpp_builder import get_cpp_compiler
    compiler = get_cpp_compiler()
    where = shutil.which(compiler) or compiler
    try:
        info = os.stat(os.path.realpath(where))
        ident = [os.path.realpath(where), info.st_size, info.st_mtime_ns]
    except OSError:
        ident = [where, None, None]
    return {"format": _MEMO_FORMAT, **machine(), "compiler": ident,
            "compiler_env": {k: os.environ.get(k) for k in ("CXX", "CC", "CPATH", "TORCH_CUDA_ARCH_LIST")}}


def _load_memo(path: str) -> set:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        if not (isinstance(data, dict) and data.get("format") == _MEMO_FORMAT and isinstance(data.get("passed"), list)
                and all(isinstance(k, str) for k in data["passed"])):
            raise ValueError("not a functrain probe memo")
        return set(data["passed"])
    except FileNotFoundError:
        return set()
    except (OSError, ValueError) as e:
        warnings.warn(f"ft.compile: ignoring the unreadable probe memo {path!r} ({type(e).__name__}: {e}); "
                      f"it is rebuilt", stacklevel=4)
        return set()


def _save_memo(path: str, passed: set) -> None:
    folder = os.path.dirname(path)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".probe-", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump({"format": _MEMO_FORMAT, "passed": sorted(passed)}, f)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


@contextlib.contextmanager
def probe_memo() -> Iterator[None]:
    """While compiling: inductor's CPU ISA probes that passed on this machine before are not run again."""
    try:
        from torch._inductor import cpu_vec_isa
    except ImportError:  # pragma: no cover - a torch without inductor's CPU backend
        yield
        return
    original = cpu_vec_isa.VecISA.check_build
    if getattr(original, "_functrain_memo", False):  # nested compile: already in place
        yield
        return
    try:
        folder = memo_folder()
        machine = json.dumps(_machine(), sort_keys=True, default=str)
    except (OSError, ValueError) as e:
        warnings.warn(f"ft.compile: no probe memo ({e}); inductor probes the CPU's vector ISAs in every "
                      f"process (seconds)", stacklevel=3)
        yield
        return
    path = os.path.join(folder, "vec_isa_probes.json")
    passed = _load_memo(path)

    def check_build(self: Any, code: str) -> bool:
        key = hashlib.sha256(json.dumps([machine, type(self).__name__, str(self), self.build_arch_flags(),
                                         code]).encode()).hexdigest()
        if key in passed:
            return True
        ok = original(self, code)
        if ok:
            passed.add(key)
            try:
                _save_memo(path, passed | _load_memo(path))  # keep what another process added meanwhile
            except OSError as e:
                warnings.warn(f"ft.compile: could not write the probe memo {path!r} ({e})", stacklevel=2)
        return ok

    check_build._functrain_memo = True  # type: ignore[attr-defined]
    cpu_vec_isa.VecISA.check_build = check_build
    try:
        yield
    finally:
        cpu_vec_isa.VecISA.check_build = original
