"""Which folders may hold code this process loads: the one rule for every compile cache.

A compile cache holds what the process later runs: inductor's output code (Python it
imports), shared libraries it ``dlopen``s, pickles AOTAutograd and Dynamo load,
precompiled headers gcc includes into every kernel, AOTInductor packages. Whoever can
write into such a folder runs code as the user. A folder is trusted only if nobody but
this user (and root, who can do anything anyway) can change what is in it:

* **the chain**: every folder above it (its real path, symlinks resolved) belongs to
  root or this user and is writable by no one else, unless it is sticky (``/tmp``:
  others cannot rename or delete what is ours there); a symlink on the way must be
  ours or root's (another user could re-point it);
* **the folder**: a real folder owned by this user, writable neither by its group nor
  by others (a group-writable team cache is refused: any member could plant code);
* **its contents**, each file and subfolder, walked before anything is loaded: owned by
  this user or root, no symlink, and not writable by a group or by others who can reach
  it (a ``0775`` subfolder inside a ``0700`` folder is unreachable for them, so fine).

:func:`check_folder` applies it (raising :class:`UntrustedFolder`, which says why);
:func:`private_home` is functrain's own folder (``0700``), where the caches go instead.

Example::

    >>> import tempfile, os
    >>> folder = check_folder(os.path.join(tempfile.mkdtemp(), "cache"))   # made 0700
    >>> oct(os.stat(folder).st_mode & 0o777)
    '0o700'
"""
from __future__ import annotations

import os
import stat
import tempfile
import warnings

__all__ = ["UntrustedFolder", "check_folder", "why_untrusted", "private_home"]


class UntrustedFolder(ValueError):
    """A folder that someone other than this user could write code into; ``reason`` says who and how."""

    def __init__(self, path: str, reason: str):
        super().__init__(f"{path!r} {reason}")
        self.path = path
        self.reason = reason


def _uid() -> int | None:
    getuid = getattr(os, "getuid", None)
    return getuid() if getuid is not None else None


def _writers(mode: int) -> str | None:
    if mode & stat.S_IWOTH:
        return "everyone"
    if mode & stat.S_IWGRP:
        return "its group"
    return None


def _chain(path: str, uid: int) -> str | None:
    """Why the folders above ``path`` (and the symlinks leading to it) let another user replace it, or None."""
    parts = os.path.abspath(path).split(os.sep)
    for i in range(2, len(parts)):  # the symlinks on the given path: another user's could be re-pointed
        sub = os.sep.join(parts[:i]) or os.sep
        try:
            info = os.lstat(sub)
        except FileNotFoundError:
            break
        if stat.S_ISLNK(info.st_mode) and info.st_uid not in (uid, 0):
            return f"is reached through the symlink {sub!r} of uid {info.st_uid}, who can re-point it"
    real = os.path.realpath(path)
    parent = os.path.dirname(real)
    while True:
        info = os.stat(parent)
        if info.st_uid not in (uid, 0):
            return (f"is inside {parent!r}, which belongs to uid {info.st_uid}: that user can replace the "
                    f"folder and what is in it")
        who = _writers(info.st_mode)
        if who is not None and not info.st_mode & stat.S_ISVTX:
            return (f"is inside {parent!r} (mode {oct(info.st_mode & 0o7777)}), writable by {who} and not "
                    f"sticky: they can replace the folder and what is in it")
        up = os.path.dirname(parent)
        if up == parent:
            return None
        parent = up


def _contents(top: str, mode: int, uid: int) -> str | None:
    """Why something inside ``top`` may not be this user's code, or None (see the module doc)."""
    stack = [(top, bool(mode & stat.S_IXGRP), bool(mode & stat.S_IXOTH))]
    while stack:
        folder, group_in, others_in = stack.pop()
        try:
            entries = list(os.scandir(folder))
        except OSError as e:
            return f"has a subfolder that cannot be read ({folder!r}: {e.strerror})"
        for entry in entries:
            try:
                info = entry.stat(follow_symlinks=False)
            except FileNotFoundError:  # removed meanwhile (a temporary file of a compile in progress)
                continue
            if stat.S_ISLNK(info.st_mode):
                return f"holds a symlink, {entry.path!r} (a compile cache has none: planted?)"
            if info.st_uid not in (uid, 0):
                return f"holds {entry.path!r}, which belongs to uid {info.st_uid} (planted by another user?)"
            if (group_in and info.st_mode & stat.S_IWGRP) or (others_in and info.st_mode & stat.S_IWOTH):
                who = "everyone" if others_in and info.st_mode & stat.S_IWOTH else "its group"
                return f"holds {entry.path!r} (mode {oct(info.st_mode & 0o7777)}), writable by {who}"
            if stat.S_ISDIR(info.st_mode):
                stack.append((entry.path, group_in and bool(info.st_mode & stat.S_IXGRP),
                              others_in and bool(info.st_mode & stat.S_IXOTH)))
    return None


def why_untrusted(path: str, *, contents: bool = True) -> str | None:
    """Why ``path`` (an existing folder) could hold code another user wrote, or ``None`` if it cannot.

    ``contents=False`` checks the chain and the folder only (for a folder made just now).
    Without ``os.getuid`` (Windows) every folder is trusted: there is no owner to compare.

    Example::

        >>> import tempfile, os
        >>> shared = tempfile.mkdtemp(); os.chmod(shared, 0o777)
        >>> why_untrusted(shared)
        'is writable by everyone (mode 0o777): anyone could plant code this process loads'
    """
    uid = _uid()
    if uid is None:  # pragma: no cover - Windows
        return None
    try:
        link = os.lstat(path)
        info = os.stat(path)
    except FileNotFoundError:
        return "does not exist"
    if stat.S_ISLNK(link.st_mode) and link.st_uid not in (uid, 0):
        return f"is a symlink of uid {link.st_uid}, who can re-point it"
    if not stat.S_ISDIR(info.st_mode):
        return "is not a folder"
    if info.st_uid != uid:
        return (f"belongs to uid {info.st_uid}, not to this user (uid {uid}): whatever it holds would be loaded "
                f"into this process")
    who = _writers(info.st_mode)
    if who is not None:
        return (f"is writable by {who} (mode {oct(info.st_mode & 0o7777)}): "
                f"{'anyone' if who == 'everyone' else 'any member'} could plant code this process loads")
    reason = _chain(path, uid)
    if reason is None and contents:
        reason = _contents(os.path.realpath(path), info.st_mode, uid)
    return reason


def check_folder(path: str | os.PathLike, *, create: bool = True, contents: bool = True) -> str:
    """``path`` as an absolute folder that only this user can write code into; raises :class:`UntrustedFolder`.

    A missing folder is made (``0o700``) when ``create``. ``contents=False``: its contents are not walked
    (a subfolder of a folder just checked).

    Example::

        >>> import tempfile, os
        >>> check_folder(os.path.join(tempfile.mkdtemp(), "a", "b")).endswith(os.path.join("a", "b"))
        True
    """
    path = os.path.abspath(os.fspath(path))
    made = False
    if create and not os.path.lexists(path):
        try:
            os.makedirs(path, mode=0o700)
            made = True
        except FileExistsError:  # made meanwhile, by whom: the checks below say
            pass
    reason = why_untrusted(path, contents=contents and not made)
    if reason is not None:
        raise UntrustedFolder(path, reason)
    return path


_warned: set = set()


def private_home() -> str:
    """functrain's own folder for compile caches, the probe memo and the package key (``0700``).

    ``FUNCTRAIN_CACHE_DIR``, else ``$XDG_CACHE_HOME/functrain``, else ``~/.cache/functrain``;
    one that fails :func:`check_folder` is skipped with a warning (once), and if none
    passes, a new temporary folder of this process's own is used (no reuse across runs).
    """
    key = (os.environ.get("FUNCTRAIN_CACHE_DIR"), os.environ.get("XDG_CACHE_HOME"), os.path.expanduser("~"))
    if key in _homes and os.path.isdir(_homes[key]):  # checked once per process (its contents are walked)
        return _homes[key]
    _homes[key] = _private_home()
    return _homes[key]


_homes: dict = {}


def _private_home() -> str:
    candidates = []
    if os.environ.get("FUNCTRAIN_CACHE_DIR"):
        candidates.append(("FUNCTRAIN_CACHE_DIR", os.environ["FUNCTRAIN_CACHE_DIR"]))
    xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    candidates.append(("the user's cache home", os.path.join(xdg, "functrain")))
    for what, folder in candidates:
        try:
            return check_folder(folder)
        except (UntrustedFolder, OSError) as e:
            key = ("home", os.path.abspath(folder))
            if key not in _warned:
                _warned.add(key)
                warnings.warn(f"functrain: not using {what} {folder!r} for compile caches: {e}", stacklevel=3)
    global _fallback
    if _fallback is None:
        _fallback = tempfile.mkdtemp(prefix="functrain-cache-")  # 0700, new: nothing in it yet
    return _fallback


_fallback: str | None = None
