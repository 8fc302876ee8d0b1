"""What makes a second compile of ``ft.compile``'s step cheap: its cache folder, a lock per graph, a probe memo.

A process that traces the same graph as an earlier one (a resumed run, a second run,
another rank) is served by AOTAutograd's and inductor's on-disk FX-graph caches, which
torch keys on the graph, the input shapes / strides / dtypes / devices, the inductor
config and the torch version: a changed loss, shape, device or torch build is a
different key, compiled afresh, never a stale entry. functrain adds three things:

* **the folder** (:func:`use_cache_dir`): ``ft.compile(step, cache_dir=...)`` points
  inductor's cache at ``cache_dir/inductor``; without ``cache_dir`` inductor's own
  folder is used (``TORCHINDUCTOR_CACHE_DIR``, else ``$TMPDIR/torchinductor_<user>``).
  Inductor reads its folder from the process-wide ``TORCHINDUCTOR_CACHE_DIR``, so the
  first folder a process compiles with is the one it keeps; a different one later is
  a warning, not a silent switch. The cache holds code the process runs, so each
  folder is checked before anything compiles (:mod:`functrain.compiler.trust`: the
  folder, the folders above it and everything in it writable by this user only,
  inductor's default folder included); a folder that fails is not loaded from:
  functrain's private ``0700`` folder is used instead, with one warning naming it and why.
* **a lock per graph** (:func:`compile_lock`): N ranks of one machine that start
  together would each compile the same graph from scratch (each misses the cache
  before any has written it). The first to arrive takes an ``flock`` on a file named
  by the traced graph's hash; the others wait (bounded: after
  ``FUNCTRAIN_COMPILE_LOCK_TIMEOUT`` seconds, 600 by default, they compile themselves
  with a warning), then find the entry the first one wrote.
* **loading what another process compiled** (:func:`refuse_codegen`): a background
  compile worker (:mod:`functrain.compiler.background`) writes the graph's entries into
  these caches; the training process then loads them with inductor's code generation
  refused, so a miss (a corrupt or missing entry, a key that differs) is an error it can
  act on, never a compile that blocks training without saying so.
* **a damaged entry is rebuilt, not kept** (:func:`set_aside_damaged`): a compile that fails on a file of the
  cache (a flipped byte in a kernel's ``.cpp``, which inductor would otherwise build again at every run) is
  retried once with that file moved aside (``<name>.damaged``), and the warning names it; a second failure
  says which folder to delete.
* **a memo of inductor's CPU probes** (:func:`probe_memo`): before its first CPU
  kernel, inductor compiles a test program per vector ISA the CPU reports and loads
  each in a child process (~7 s cold, ~1.3 s with the probes' builds cached: most of a
  small step's compile). The memo keeps which probes *passed* in a JSON file in the
  user's cache (``FUNCTRAIN_CACHE_DIR``, else ``$XDG_CACHE_HOME/functrain``, else
  ``~/.cache/functrain``), keyed by the probe's code and flags, the compiler binary
  (path, size, mtime), the host, the CPU's features and the torch build. A passed probe
  is not run again; a failed one always is (a transient failure is not remembered), so
  inductor picks the same ISA, and builds the same kernels, as without the memo.

No cache file is unpickled by functrain: the memo is JSON, written atomically (temp
file + rename); an unreadable or foreign memo is rebuilt with a warning, never trusted.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import sys
import tempfile
import time
import warnings
from typing import Any, Iterator

import torch

from . import trust

__all__ = ["use_cache_dir", "trusted_folder", "compile_lock", "GraphLock", "probe_memo", "graph_key",
           "check_private_folder", "machine", "NotCached", "refuse_codegen", "set_aside_damaged",
           "CacheDamaged", "inductor_dir"]

_MEMO_FORMAT = 1
_active: str | None = None  # the inductor folder this process compiles into (set by use_cache_dir)
_warned: set = set()  # the untrusted folders already warned about (once per process each)
_trusted: dict = {}  # folder -> the folder used for it, as trusted_folder decided (once per process)


def check_private_folder(path: str, *, create: bool = True, contents: bool = True) -> str:
    """``path`` as an absolute folder only this user can write code into (raises ``ValueError`` saying why).

    The rule (:mod:`functrain.compiler.trust`): the folder and every folder above it belong to this user
    (or root), none is writable by a group or by others (a sticky ``/tmp`` above it is fine), and nothing in
    it belongs to another user, is a symlink, or is writable by others who can reach it (``contents=False``:
    not walked, for a folder inside one just checked). New folders are made ``0o700``.

    Example::

        >>> import tempfile, os
        >>> oct(os.stat(check_private_folder(os.path.join(tempfile.mkdtemp(), "c"))).st_mode & 0o777)
        '0o700'
    """
    try:
        return trust.check_folder(path, create=create, contents=contents)
    except trust.UntrustedFolder as e:
        raise ValueError(f"ft.compile cache folder {e}; use a folder of your own") from None


def _warn_once(key: Any, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        warnings.warn(message, stacklevel=4)


def trusted_folder(folder: str, what: str, contents: bool = True) -> str:
    """``folder`` if only this user can write code into it, else functrain's private folder for the same
    use (``private_home()/<basename>``), with one warning naming ``folder`` and why."""
    key = os.path.abspath(folder)
    if key in _trusted:  # checked in this process: only this user can have written into it since
        return _trusted[key]
    try:
        _trusted[key] = check_private_folder(folder, contents=contents)
        return _trusted[key]
    except (ValueError, OSError) as e:
        instead = check_private_folder(os.path.join(trust.private_home(), os.path.basename(folder)), contents=False)
        _warn_once(("folder", os.path.abspath(folder)),
                   f"ft.compile: not loading compiled code from {what} {os.path.abspath(folder)!r}: "
                   f"{e.args[0] if isinstance(e, ValueError) else e}. Using this user's private folder "
                   f"{instead!r} instead")
        return instead


def use_cache_dir(cache_dir: Any = None) -> str:
    """Make the inductor cache of this process a folder only this user can write; returns the folder in use.

    ``cache_dir`` given: ``cache_dir/inductor``; ``None``: inductor's own choice
    (``TORCHINDUCTOR_CACHE_DIR``, else ``$TMPDIR/torchinductor_<user>``, what ``ft.Trainer`` uses). A
    folder that fails :func:`check_private_folder` (another user made it, a group can write it, it holds
    another user's files) is not loaded from: functrain's private folder is used instead, with one warning
    naming the folder and why. Called before anything compiles (Dynamo reads its own pickles from the
    folder before a backend runs). Inductor's folder is process-wide: the first call decides it, a later
    call with another folder warns and keeps the first.

    Example::

        use_cache_dir("results/compile_cache")   # what ft.compile(step, cache_dir=...) calls
    """
    global _active
    if cache_dir is not None and not isinstance(cache_dir, (str, os.PathLike)):
        raise TypeError(f"ft.compile(cache_dir=...) takes a folder path (str or os.PathLike); "
                        f"got {type(cache_dir).__name__}")
    if cache_dir is None:
        current = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
        if _active is not None and (current is None or os.path.abspath(current) == _active):
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = _active
            return _active  # (changed by someone since: what inductor would use now is checked below)
        wanted = os.environ.get("TORCHINDUCTOR_CACHE_DIR") or _default_inductor_dir()
        what = ("TORCHINDUCTOR_CACHE_DIR" if os.environ.get("TORCHINDUCTOR_CACHE_DIR")
                else "inductor's default cache folder")
    else:
        wanted = os.path.join(trusted_folder(os.fspath(cache_dir), "the cache_dir"), "inductor")
        what = "the cache_dir"  # (its contents, inductor/ with them, were walked just now)
    wanted = os.path.abspath(wanted)
    current = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if _active is None and current is not None and _inductor_compiled():
        _active = os.path.abspath(current)  # inductor has compiled in this process, into its folder
    if _active is not None and _active != wanted and cache_dir is not None:
        warnings.warn(f"ft.compile(cache_dir={os.fspath(cache_dir)!r}): this process already compiles into "
                      f"{_active!r} (inductor's cache folder is process-wide, TORCHINDUCTOR_CACHE_DIR); "
                      f"keeping that one", stacklevel=3)
        wanted = _active
    folder = trusted_folder(wanted, what, contents=cache_dir is None or wanted == _active)
    _guard_defaults(folder)
    if os.environ.get("TRITON_CACHE_DIR"):  # GPU kernels: Triton's cache, when not inside inductor's folder
        os.environ["TRITON_CACHE_DIR"] = trusted_folder(os.environ["TRITON_CACHE_DIR"], "TRITON_CACHE_DIR")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = folder
    _active = folder
    return folder


def _default_inductor_dir() -> str:
    """Inductor's default cache folder (``$TMPDIR/torchinductor_<user>``), computed as inductor does,
    without importing inductor (seconds) when it is not imported yet."""
    utils = sys.modules.get("torch._inductor.runtime.cache_dir_utils")
    if utils is not None:
        return (_original_default[0] if _original_default else utils.default_cache_dir)()
    import getpass
    import re
    try:
        user = getpass.getuser()
    except (KeyError, ModuleNotFoundError, OSError):
        user = f"uid_{os.getuid()}" if hasattr(os, "getuid") else "unknown_user"
    return os.path.join(tempfile.gettempdir(), "torchinductor_" + re.sub(r'[\\/:*?"<>|]', "_", user))


def _guard_defaults(folder: str) -> None:
    """Inductor keeps a few things in its *default* folder whatever ``TORCHINDUCTOR_CACHE_DIR`` says
    (precompiled headers, which gcc includes into every CPU kernel; two on-disk caches): if that folder
    is not trusted, they go to ``folder`` too (:func:`_redirect_defaults`, applied before inductor compiles)."""
    global _redirect_to
    path = _default_inductor_dir()
    if os.path.abspath(path) == os.path.abspath(folder):  # checked already: it is the folder in use
        return
    try:
        check_private_folder(path)  # (made 0o700 if missing, so that nobody else makes it first)
        return
    except (ValueError, OSError) as e:
        _warn_once(("folder", os.path.abspath(path)),
                   f"ft.compile: not loading compiled code from inductor's default cache folder "
                   f"{os.path.abspath(path)!r}: {e.args[0] if isinstance(e, ValueError) else e}. "
                   f"Using {folder!r} for what inductor keeps there (precompiled headers)")
    _redirect_to = folder
    if "torch._inductor.runtime.cache_dir_utils" in sys.modules:
        _redirect_defaults()


def _redirect_defaults() -> None:
    """Point inductor's ``default_cache_dir`` (each module's binding of it) and its precompiled-header folder
    at the trusted folder chosen by :func:`_guard_defaults`; called before inductor compiles."""
    folder = _redirect_to
    if folder is None:
        return
    from torch._inductor.runtime import cache_dir_utils
    if not _original_default:
        _original_default.append(cache_dir_utils.default_cache_dir)

    def trusted_default() -> str:
        return folder

    # default_cache_dir is imported by name into these modules: each binding is replaced
    for name in ("torch._inductor.runtime.cache_dir_utils", "torch._inductor.runtime.runtime_utils",
                 "torch._inductor.codecache"):
        module = sys.modules.get(name)
        if module is not None and hasattr(module, "default_cache_dir"):
            module.default_cache_dir = trusted_default
    codecache = sys.modules.get("torch._inductor.codecache")
    if codecache is not None and hasattr(codecache, "_HEADER_DIR"):  # computed when codecache was imported
        codecache._HEADER_DIR = os.path.join(folder, "precompiled_headers")
        codecache._HEADER_LOCK_DIR = os.path.join(codecache._HEADER_DIR, "locks")


_original_default: list = []  # inductor's own default_cache_dir, once replaced
_redirect_to: str | None = None  # where inductor's default folder's contents go when it is not trusted


def _inductor_compiled() -> bool:
    """Whether inductor has compiled (or loaded) a graph in this process (its folder is then in use)."""
    utils = sys.modules.get("torch._dynamo.utils")
    counters = getattr(utils, "counters", None)
    return bool(counters is not None and counters.get("inductor"))


def _inductor_dir() -> str:
    """The inductor folder this process compiles into, checked (:func:`use_cache_dir`; again if
    ``TORCHINDUCTOR_CACHE_DIR`` was changed since)."""
    return use_cache_dir(None)


def graph_key(gm: torch.fx.GraphModule, inputs: list) -> str:
    """A hash of a traced graph and its inputs' metadata: names the graph's lock (not a cache key:
    torch's caches key on the graph themselves)."""
    h = hashlib.sha256()
    h.update(torch.__version__.encode())
    h.update(gm.code.encode())
    for t in inputs:
        h.update(repr((tuple(t.shape), t.stride(), str(t.dtype), str(t.device))).encode())
    return h.hexdigest()[:40]


class GraphLock:
    """The machine-wide lock on graph ``key``: an ``flock`` on a file named by the key in a private folder beside
    inductor's cache. The kernel releases it when the process that holds it exits, however it exits.

    :func:`compile_lock` holds it around one compile. A background compile holds it longer, on the training
    thread, for as long as the worker it started compiles the graph, so that the machine's other processes
    see at once that the graph is being compiled and load the result instead of starting a worker of their
    own (:class:`functrain.compiler.jobs.SharedJob`). Without ``fcntl`` (Windows) or a writable lock folder
    there is no lock (:attr:`usable` is false): :meth:`acquire` succeeds and nothing is ever held elsewhere.
    """

    def __init__(self, key: str):
        self.key = key
        self.fd: int | None = None
        self.held = False
        self.usable = False
        self.reason = ""
        try:
            import fcntl
        except ImportError:  # pragma: no cover - Windows
            self.reason = "no fcntl"
            return
        self._fcntl = fcntl
        _redirect_defaults()  # inductor compiles next: its default folder must be the trusted one by then
        try:
            folder = check_private_folder(os.path.join(_inductor_dir(), "functrain-locks"))
            self.fd = os.open(os.path.join(folder, key + ".lock"), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
        except (OSError, ValueError) as e:
            self.reason = str(e)
            return
        self.usable = True

    def acquire(self, block: bool = False) -> bool:
        """Take the lock (``block``: wait for it, unbounded: only a worker's take-over thread does); whether it
        is held now. Without a usable lock: ``True``."""
        if not self.usable:
            return True
        if not self.held:
            try:
                self._fcntl.flock(self.fd, self._fcntl.LOCK_EX | (0 if block else self._fcntl.LOCK_NB))
            except BlockingIOError:
                return False
            self.held = True
        return True

    def held_elsewhere(self) -> bool:
        """Whether another process holds the lock now (a probe: taken and released at once when free)."""
        if not self.usable or self.held:
            return False
        if not self.acquire():
            return True
        self.release()
        return False

    def release(self) -> None:
        """Let the lock go if this process holds it (the file stays open: it can be taken again)."""
        if self.held:
            self._fcntl.flock(self.fd, self._fcntl.LOCK_UN)
            self.held = False

    def close(self) -> None:
        """Release the lock and close its file; the lock is unusable afterwards."""
        self.release()
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
            self.usable = False

    def __del__(self) -> None:
        if getattr(self, "fd", None) is not None:
            try:
                os.close(self.fd)
            except OSError:  # pragma: no cover
                pass


@contextlib.contextmanager
def compile_lock(key: str, timeout: float) -> Iterator[bool]:
    """Hold the machine-wide lock on graph ``key`` while compiling it (yields whether it is held).

    Another process holding it is waited for, at most ``timeout`` seconds
    (``FUNCTRAIN_COMPILE_LOCK_TIMEOUT``, read by :mod:`functrain.compiler.settings`); after that this one
    compiles anyway (a warning says so). Without ``fcntl`` (Windows) or a writable lock folder there is no
    lock: each process compiles itself.
    """
    lock = GraphLock(key)
    if not lock.usable:
        if lock.reason != "no fcntl":
            warnings.warn(f"ft.compile: no compile lock ({lock.reason}); processes starting together may each "
                          f"compile this graph", stacklevel=3)
        yield False
        return
    try:
        deadline = time.monotonic() + timeout
        while not lock.acquire():
            if time.monotonic() >= deadline:
                warnings.warn(f"ft.compile: another process has been compiling this graph for over "
                              f"{timeout:g} s (FUNCTRAIN_COMPILE_LOCK_TIMEOUT); compiling it here too",
                              stacklevel=3)
                break
            time.sleep(0.05)
        yield lock.held
    finally:
        lock.close()


# -- the probe memo ---------------------------------------------------------------------------
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


# -- loading without compiling ---------------------------------------------------------------------
class NotCached(RuntimeError):
    """Inductor would have had to generate code for a graph that was to be loaded from the caches."""


@contextlib.contextmanager
def refuse_codegen() -> Iterator[None]:
    """While loading a graph from the caches: compiling it raises :class:`NotCached` instead.

    AOTAutograd's and inductor's caches hit as usual (reading an entry traces nothing and generates
    no code); a miss reaches AOTAutograd's ``create_aot_state`` (the trace of the graph) or inductor's
    ``fx_codegen_and_compile``, which are replaced for the duration. (Process-wide: only the training
    thread loads, and nothing else compiles in this process then.)
    """
    patched = []
    for module_name, attr in (("torch._functorch.aot_autograd", "create_aot_state"),
                              ("torch._inductor.compile_fx", "fx_codegen_and_compile")):
        try:
            import importlib
            module = importlib.import_module(module_name)
            patched.append((module, attr, getattr(module, attr)))
        except (ImportError, AttributeError):  # pragma: no cover - another torch layout: that part unguarded
            continue

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise NotCached("the compile caches hold no usable entry for this graph (it would be compiled here)")

    for module, attr, _ in patched:
        setattr(module, attr, refuse)
    try:
        yield
    finally:
        for module, attr, original in patched:
            setattr(module, attr, original)


# -- damaged entries --------------------------------------------------------------------------
_PATH = None


class CacheDamaged(RuntimeError):
    """A compile failed on a cached file twice, the second time with that file moved aside: the message names
    the compile cache folder to delete."""


def inductor_dir() -> str:
    """The inductor cache folder this process compiles into (checked: :func:`use_cache_dir`)."""
    return _inductor_dir()


def set_aside_damaged(error: BaseException) -> list[str]:
    """Move aside the cache files that ``error`` (a failed compile, and its causes) names: files of this
    process's inductor folder (a damaged ``.cpp`` that inductor finds on disk and builds again and again, for
    good), each renamed to ``<name>.damaged`` beside it so that the next compile writes it afresh. Returns the
    files moved (none: the error names no cache file, and the caller re-raises it). A link is never followed
    or moved."""
    import re

    global _PATH
    if _PATH is None:
        _PATH = re.compile(r"(/[^\s'\"`:;,()\[\]]+)")
    try:
        root = os.path.realpath(_inductor_dir()) + os.sep
    except (OSError, ValueError):
        return []
    texts, seen, e = [], set(), error
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        texts.append(str(e))
        e = e.__cause__ or e.__context__
    moved: list[str] = []
    for path in dict.fromkeys(p for text in texts for p in _PATH.findall(text)):
        real = os.path.realpath(os.path.dirname(path))
        if not (real + os.sep).startswith(root) or os.path.islink(path) or not os.path.isfile(path):
            continue
        try:
            os.replace(path, path + ".damaged")
        except OSError:
            continue
        moved.append(path)
    return moved
