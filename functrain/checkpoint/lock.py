"""OS-level locks: one writer per folder (:class:`FolderLock`), and "in use" marks on the folders of a save.

Both are ``flock`` locks, which the kernel releases when the holding process
dies (SIGKILL included): a lock never outlives its holder, so a stale one is
simply taken over. On Linux, NFS emulates ``flock`` with byte-range locks that
the server sees, so the lock holds across machines sharing the folder too.
"""
from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import time
from typing import Any

from .bounded import loads_json
from .safe_io import open_fd

__all__ = ["FolderLock", "FolderLocked", "hold_dir", "try_hold_dir"]


class FolderLocked(RuntimeError):
    """Another live process holds the :class:`FolderLock` of a folder (a ``RuntimeError``).

    Args:
        message: the error's text, naming the folder, the holder and what to do.
        folder: the locked folder, kept as the attribute ``folder``.
        holder: what the holder wrote in the lock file (``{"pid", "host", "since"}``), or ``None``
            when unreadable; kept as ``holder``.

    Example::

        >>> import os, tempfile
        >>> from functrain.checkpoint import FolderLock, FolderLocked
        >>> folder = tempfile.mkdtemp()
        >>> with FolderLock(folder):
        ...     try:
        ...         FolderLock(folder).acquire()
        ...     except FolderLocked as e:
        ...         print(e.folder == folder, e.holder["pid"] == os.getpid())
        True True
    """

    __module__ = "functrain.checkpoint"  # its public home, in reprs and tracebacks

    def __init__(self, message: str, folder: str, holder: dict | None):
        super().__init__(message)
        self.folder, self.holder = folder, holder


def _busy(e: OSError) -> bool:
    return e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES)


class FolderLock:
    """An exclusive lock on ``folder`` (``flock`` on ``folder/.lock``), for one writer at a time.

    ``acquire()`` never waits: when a live process holds the lock it raises
    :class:`FolderLocked` naming the folder and the holder (pid, host and start
    time, which the holder writes into the lock file). The kernel drops the lock
    when its holder exits or is killed, so a lock left by a dead process is taken
    over without any cleanup. Use it as a context manager or call ``release()``.

    Args:
        folder: the folder to lock (created if needed); a ``.lock`` that is a symbolic link is
            refused (:class:`LinkRefused`).

    Attributes:
        folder: the folder's absolute path.
        path: the lock file, ``folder/.lock``.
        held: whether this object holds the lock.

    Example::

        >>> import os, tempfile
        >>> from functrain.checkpoint import FolderLock
        >>> with FolderLock(tempfile.mkdtemp()) as lock:
        ...     lock.holder()["pid"] == os.getpid()
        True
    """

    __module__ = "functrain.checkpoint"  # its public home, in reprs and tracebacks

    NAME = ".lock"

    def __init__(self, folder: str | os.PathLike):
        self.folder = os.path.abspath(os.fspath(folder))
        self.path = os.path.join(self.folder, self.NAME)
        self._fd: int | None = None

    def __repr__(self) -> str:
        return f"FolderLock({self.folder!r}, held={self._fd is not None})"

    @property
    def held(self) -> bool:
        """Whether this object holds the lock."""
        return self._fd is not None

    def acquire(self) -> "FolderLock":
        """Take the lock without waiting (again on a held lock: nothing happens).

        Returns:
            This lock.

        Raises:
            FolderLocked: another live process holds it; the message names it.
            LinkRefused: ``folder/.lock`` is a symbolic link.
        """
        if self._fd is not None:
            return self
        os.makedirs(self.folder, exist_ok=True)
        # never through a link: a .lock planted as a link to another file would be truncated below
        fd = open_fd(self.path, os.O_RDWR | os.O_CREAT, 0o644, what="the results folder's lock")
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            holder = _read_holder(fd)
            os.close(fd)
            if not _busy(e):
                raise
            who = "another process (it has not written its name yet)" if holder is None else \
                f"process {holder.get('pid')} on host {holder.get('host')!r}" + (
                    f" (since {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(holder['since']))})"
                    if isinstance(holder.get("since"), (int, float)) else "")
            raise FolderLocked(f"{self.folder} is in use by {who}: one run writes to a results folder at a time "
                               f"(lock file {self.path}); stop that run or use another folder", self.folder,
                               holder) from None
        info = json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "since": time.time()}).encode()
        os.ftruncate(fd, 0)
        os.pwrite(fd, info, 0)
        self._fd = fd
        return self

    def release(self) -> None:
        """Drop the lock (the lock file stays; its next holder overwrites it); nothing happens if it is not held.

        Returns:
            ``None``.
        """
        fd, self._fd = self._fd, None
        if fd is not None:
            try:
                os.ftruncate(fd, 0)
            except OSError:
                pass
            os.close(fd)  # closing the last descriptor releases the flock

    def holder(self) -> dict | None:
        """Who holds (or last held) the lock, as written in the lock file.

        Returns:
            ``{"pid", "host", "since"}``, or ``None`` when there is no readable lock file (a link included).
        """
        try:
            fd = open_fd(self.path, os.O_RDONLY, what="the results folder's lock")
        except OSError:  # (a link included: its holder is unknown)
            return None
        try:
            return _read_holder(fd)
        finally:
            os.close(fd)

    def __enter__(self) -> "FolderLock":
        return self.acquire()

    def __exit__(self, *exc: Any) -> None:
        self.release()


def _read_holder(fd: int) -> dict | None:
    try:
        data = os.pread(fd, 4096, 0)  # (a holder's line is ~80 bytes: the rest, if any, is not ours)
        info = loads_json(data, "lock") if data else None
    except (OSError, ValueError, UnicodeDecodeError):
        return None
    return info if isinstance(info, dict) else None


def hold_dir(path: str) -> int:
    """Mark the folder ``path`` as in use by this process (waits for a tidier that holds it); returns the fd.

    The mark moves with the folder when it is renamed and lasts until the fd is
    closed (or the process dies).
    """
    fd = open_fd(path, os.O_RDONLY | os.O_DIRECTORY, what="a checkpoint folder")  # a link is refused
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
    except BaseException:
        os.close(fd)
        raise
    return fd


def try_hold_dir(path: str) -> int | None:
    """The fd of ``path`` with its in-use mark taken, or ``None`` if a live process holds it (or it is gone)."""
    try:
        fd = open_fd(path, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:  # gone, or a link (never ours to tidy)
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    return fd
