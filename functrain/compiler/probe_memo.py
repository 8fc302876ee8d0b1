"""A memo of inductor's CPU probes, so a second compile on this machine does not run them again.

Before its first CPU kernel, inductor compiles a test program per vector ISA the CPU reports and loads each in a
child process (~7 s cold, ~1.3 s with the probes' builds cached: most of a small step's compile). The memo keeps
which probes *passed* in a JSON file in the user's private folder (:func:`functrain.compiler.trust.private_home`),
keyed by the probe's code and flags, the compiler binary (path, size, mtime), the host, the CPU's features and the
torch build. A passed probe is not run again; a failed one is, by the next process (a transient failure is not
remembered on disk), so inductor picks the same ISA, and builds the same kernels, as without the memo. No file is
unpickled: the memo is JSON, written atomically (temp file + rename); an unreadable or foreign memo is rebuilt with a
warning. A process's first compile of a CPU graph starts the probes side by side at once (:func:`_probe_ahead`),
each run once.
"""
from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import os
import sys
import tempfile
import threading
import warnings
from concurrent.futures import Future
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
def probe_memo(ahead: bool = False) -> Iterator[None]:
    """While compiling: inductor's CPU ISA probes that passed on this machine before are not run again.

    ``ahead``: a compile that will generate CPU code (a graph whose inputs are all on the CPU) starts the probes
    at once, side by side (:func:`_probe_ahead`; the block's end waits for them). Off for a load from the caches
    and for a GPU graph, which may need no probe at all."""
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
    inflight: dict = {}  # probe key -> its outcome (a Future), for this block
    inflight_lock = threading.Lock()

    def check_build(self: Any, code: str) -> bool:
        key = hashlib.sha256(json.dumps([machine, type(self).__name__, str(self), self.build_arch_flags(),
                                         code]).encode()).hexdigest()
        if key in passed:
            return True
        with inflight_lock:  # one run per probe: a second asker (inductor, while a probe started ahead runs) waits
            running, first = inflight.get(key), key not in inflight
            if first:
                running = inflight[key] = Future()
        if not first:
            return running.result()
        try:
            ok = original(self, code)
        except BaseException as e:
            running.set_exception(e)
            raise
        running.set_result(ok)
        if ok:
            passed.add(key)
            try:
                _save_memo(path, passed | _load_memo(path))  # keep what another process added meanwhile
            except OSError as e:
                warnings.warn(f"ft.compile: could not write the probe memo {path!r} ({e})", stacklevel=2)
        return ok

    check_build._functrain_memo = True  # type: ignore[attr-defined]
    cpu_vec_isa.VecISA.check_build = check_build
    started = _probe_ahead(cpu_vec_isa) if ahead else []
    try:
        yield
    finally:
        for t in started:  # (each probe is bounded by inductor: a build, then a load with a timeout)
            t.join(_PROBE_JOIN_S)
        cpu_vec_isa.VecISA.check_build = original


_PROBE_JOIN_S = 600.0
_probed_ahead = False  # once per process


def _probe_ahead(cpu_vec_isa: Any) -> list:
    """Inductor's x86 ISA probes started at once, side by side, each on a thread (the probe is a compiler child
    process, waited for without the GIL), instead of one after the other when the first kernel is generated.

    They then run beside the compile's tracing and passes, on a core those leave free (a new machine's W1: the
    probes 9.0 -> 4.9 s, bench/README.md, issue 41). Inductor's own question later finds each outcome by its
    probe key (waiting for a probe still running) and runs none twice; a probe this machine passed before is a
    memo hit at once. Only where inductor has not asked yet in this process, on x86 (the only platform with
    several candidates)."""
    global _probed_ahead
    import platform
    if _probed_ahead or platform.machine() not in ("x86_64", "AMD64") \
            or cpu_vec_isa.valid_vec_isa_list.cache_info().currsize:
        return []
    _probed_ahead = True
    try:
        flags = cpu_vec_isa.x86_isa_checker()
        candidates = [isa for isa in cpu_vec_isa.supported_vec_isa_list
                      if all(flag in flags for flag in str(isa).split())]
    except Exception:  # noqa: BLE001 - another torch's layout: inductor probes as it always does
        return []
    # each on a copy of inductor's ISA object: a probe changes its object's flags for a while (its bf16 check), and
    # inductor's own question may meanwhile be asking the original; outcomes meet in the memo by probe key
    threads = [threading.Thread(target=bool, args=(copy.copy(isa),), name=f"functrain-probe-{isa}", daemon=True)
               for isa in candidates]
    for t in threads:
        t.start()
    return threads
