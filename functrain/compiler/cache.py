"""Compile cache folders: where inductor's caches live, checked before anything loads from them.

A process that traces the same graph as an earlier one (a resumed run, a second run,
another rank) is served by AOTAutograd's and inductor's on-disk FX-graph caches, which
torch keys on the graph, the input shapes / strides / dtypes / devices, the inductor
config and the torch version: a changed loss, shape, device or torch build is a
different key, compiled afresh, never a stale entry. The cache's concepts, one module each:

* **the folder** (here, :func:`use_cache_dir`): ``ft.compile(step, cache_dir=...)`` points
  inductor's cache at ``cache_dir/inductor``; without ``cache_dir`` inductor's own
  folder is used (``TORCHINDUCTOR_CACHE_DIR``, else ``$TMPDIR/torchinductor_<user>``).
  Inductor reads its folder from the process-wide ``TORCHINDUCTOR_CACHE_DIR``, so the
  first folder a process compiles with is the one it keeps; a different one later is
  a warning, not a silent switch. The cache holds code the process runs, so each
  folder is checked before anything compiles (:mod:`functrain.compiler.trust`: the
  folder, the folders above it and everything in it writable by this user only,
  inductor's default folder included); a folder that fails is not loaded from:
  functrain's private ``0700`` folder is used instead, with one warning naming it and why.
* **a damaged entry is rebuilt, not kept** (here, :func:`set_aside_damaged`): a compile that fails on a file of
  the cache (a flipped byte in a kernel's ``.cpp``, which inductor would otherwise build again at every run) is
  retried once with that file moved aside (``<name>.damaged``), and the warning names it; a second failure
  says which folder to delete.
* **a lock per graph** (:mod:`functrain.compiler.graph_lock`): one process of a machine compiles a graph, the
  others wait for it (bounded) and load its entry.
* **loading what another process compiled** (:mod:`functrain.compiler.codegen`): with inductor's code
  generation refused, so a miss is an error to act on, never a silent compile.
* **a memo of inductor's CPU probes** (:mod:`functrain.compiler.probe_memo`): a passed probe is not run again.
* **who may write a folder code is loaded from** (:mod:`functrain.compiler.trust`).
"""
from __future__ import annotations

import os
import sys
import tempfile
import warnings
from typing import Any

from . import trust

__all__ = ["use_cache_dir", "trusted_folder", "check_private_folder", "inductor_dir", "redirect_defaults",
           "set_aside_damaged", "CacheDamaged"]

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
    is not trusted, they go to ``folder`` too (:func:`redirect_defaults`, applied before inductor compiles)."""
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
        redirect_defaults()


def redirect_defaults() -> None:
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
