"""Writing into a results folder only through names it owns: no symlink is ever followed on a write.

Another user who can write into a folder (a shared scratch folder, a group-writable
results folder) can plant a symbolic link where functrain is about to write, say
``results/metrics.jsonl -> ~/.bashrc``, or predict a temporary name
(``.metrics.png.tmp-<pid>``) and plant a link there. Writing through such a link
truncates or overwrites a file outside the folder. Every writer of a results
folder (the lock, the trackers' logs, the config, the plots, the sample grids, the
exported weights, the checkpoints' temporary folders) goes through these helpers:

* :func:`open_fd` opens with ``O_NOFOLLOW`` (a link as the last name is refused;
  ``O_CREAT | O_EXCL`` also refuses any existing name, a link included);
* :func:`replace_file` writes a new file under a random temporary name created
  with ``O_CREAT | O_EXCL`` (never an existing name) beside the target, then
  renames it over the target, after checking the target is not a link (a rename
  replaces a link itself, never what it points to);
* :func:`check_not_link` refuses a link where a file or a folder of ours should be.

A refusal is a :class:`LinkRefused` (an ``OSError``, ``errno.ELOOP``) naming the
link and where it points; nothing outside the folder is written or truncated.

Example::

    >>> import os, tempfile
    >>> from functrain.checkpoint.safe_io import LinkRefused, replace_file
    >>> folder = tempfile.mkdtemp()
    >>> os.symlink("/etc/hostname", os.path.join(folder, "config.json"))
    >>> try:
    ...     replace_file(os.path.join(folder, "config.json"), b"{}")
    ... except LinkRefused as e:
    ...     print("refused:", os.path.basename(e.filename))
    refused: config.json
"""
from __future__ import annotations

import errno
import os
import secrets
import stat
from typing import Any, Callable, IO

__all__ = ["LinkRefused", "open_fd", "open_append", "open_read", "check_not_link", "check_dir", "replace_file",
           "replace_created", "new_temp"]

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


class LinkRefused(OSError):
    """A symbolic link where functrain writes a file or a folder of its own: refused, nothing written through it.

    An ``OSError`` with ``errno.ELOOP``; ``filename`` is the link.

    Args:
        path: the link.
        what: what functrain was writing there, for the message (default ``"a file functrain writes"``).

    Example::

        >>> import os, tempfile, torch, functrain as ft
        >>> link = os.path.join(tempfile.mkdtemp(), "ckpt")
        >>> os.symlink("/elsewhere", link)   # planted where a checkpoint will be written
        >>> try:
        ...     ft.save(link, {"w": torch.ones(1)})
        ... except ft.checkpoint.LinkRefused as e:
        ...     print(e.filename == link)
        True
    """

    __module__ = "functrain.checkpoint"  # its public home, in reprs and tracebacks

    def __init__(self, path: str, what: str = "a file functrain writes"):
        try:
            target = os.readlink(path)
        except OSError:
            target = "?"
        super().__init__(errno.ELOOP, f"{path} is a symbolic link (to {target!r}) where functrain writes {what}: "
                                      f"refusing to write through it (another user may have planted it); remove "
                                      f"the link", path)

    def __str__(self) -> str:
        return self.strerror


def check_not_link(path: str, what: str = "a file functrain writes") -> None:
    """Raise :class:`LinkRefused` if ``path`` is a symbolic link (a missing path is fine)."""
    if os.path.islink(path):
        raise LinkRefused(path, what)


def check_dir(path: str, what: str = "a folder functrain writes into") -> None:
    """Refuse a folder of ours that is a symbolic link planted by another user.

    A link owned by this user (``ln -s /big/disk results/checkpoints``) is the user's own choice and is
    followed; one owned by anyone else is refused with :class:`LinkRefused`.
    """
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if stat.S_ISLNK(st.st_mode) and st.st_uid != os.geteuid():
        raise LinkRefused(path, what)


def open_fd(path: str, flags: int, mode: int = 0o644, *, dir_fd: int | None = None,
            what: str = "a file functrain writes") -> int:
    """``os.open(path, flags | O_NOFOLLOW | O_CLOEXEC)``; a link at ``path`` raises :class:`LinkRefused`.

    With ``dir_fd`` the name is resolved in that open folder (``path`` is then a name in it), so a folder
    renamed or replaced under us cannot redirect the write.
    """
    try:
        return os.open(path, flags | _NOFOLLOW | _CLOEXEC, mode, dir_fd=dir_fd)
    except OSError as e:
        full = path if dir_fd is None else os.path.join(_fd_path(dir_fd), path)
        if e.errno == errno.ELOOP or (e.errno == errno.EEXIST and os.path.islink(full)):
            raise LinkRefused(full, what) from None
        raise


def _fd_path(fd: int) -> str:
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return f"<folder fd {fd}>"


def open_append(path: str, what: str = "a log functrain appends to") -> IO[str]:
    """A text file opened for appending (created if missing), never through a link."""
    fd = open_fd(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644, what=what)
    return os.fdopen(fd, "a", encoding="utf-8")


def open_read(path: str, what: str = "a file functrain reads back") -> IO[bytes]:
    """A file opened for reading, never through a link (for files functrain wrote and rewrites)."""
    return os.fdopen(open_fd(path, os.O_RDONLY, what=what), "rb")


def new_temp(path: str, mode: int = 0o644) -> tuple[str, int]:
    """A new temporary file beside ``path`` (``.<name>.tmp-<random>``, created ``O_CREAT | O_EXCL``) and its fd."""
    folder, name = os.path.split(os.path.abspath(path))
    for _ in range(16):
        tmp = os.path.join(folder, f".{name}.tmp-{secrets.token_hex(6)}")
        try:
            return tmp, open_fd(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
        except FileExistsError:  # (a name planted or left there: take another)
            continue
    raise FileExistsError(errno.EEXIST, f"cannot create a temporary file beside {path}: every name tried exists")


def _discard(tmp: str) -> None:
    """Remove a temporary file of ours after a failed write (never through a link planted at its name)."""
    try:
        if not os.path.islink(tmp):
            os.unlink(tmp)
    except OSError:
        pass


def replace_file(path: str | os.PathLike, data: bytes | Callable[[IO[bytes]], Any], *, fsync: bool = False,
                 mode: int = 0o644, what: str = "a file functrain writes") -> str:
    """Write ``path`` atomically: a new temporary file beside it, then a rename over it; returns the path.

    ``data`` is the bytes, or a function ``write(f)`` given the temporary file opened in binary mode (a
    plotting library's ``savefig``, say). A link at ``path`` raises :class:`LinkRefused` before anything is
    written; the temporary file is removed on any error. ``fsync`` flushes the file (and the rename) to disk.
    """
    path = os.path.abspath(os.fspath(path))
    folder = os.path.dirname(path)
    os.makedirs(folder, exist_ok=True)
    check_not_link(path, what)
    tmp, fd = new_temp(path, mode)
    try:
        with os.fdopen(fd, "wb") as f:
            if callable(data):
                data(f)
            else:
                f.write(data)
            f.flush()
            if fsync:
                os.fsync(f.fileno())
        check_not_link(path, what)  # (a rename would replace a link itself, but say so rather than hide it)
        os.replace(tmp, path)
    except BaseException:
        _discard(tmp)
        raise
    if fsync:
        _fsync_dir(folder)
    return path


def replace_created(path: str | os.PathLike, create: Callable[[str], Any], *, fsync: bool = False,
                    what: str = "a file functrain writes") -> str:
    """:func:`replace_file` for a writer that creates its file itself: ``create(tmp)`` must create the new
    file ``tmp`` exclusively (``O_CREAT | O_EXCL``, as :func:`open_fd` does); it is renamed over ``path``."""
    path = os.path.abspath(os.fspath(path))
    folder, name = os.path.split(path)
    os.makedirs(folder, exist_ok=True)
    check_not_link(path, what)
    tmp = os.path.join(folder, f".{name}.tmp-{secrets.token_hex(6)}")
    try:
        create(tmp)
        check_not_link(path, what)
        os.replace(tmp, path)
    except BaseException:
        _discard(tmp)
        raise
    if fsync:
        _fsync_dir(folder)
    return path


def _fsync_dir(folder: str) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | _CLOEXEC)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
