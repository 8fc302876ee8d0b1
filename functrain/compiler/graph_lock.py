"""The per-graph machine-wide lock: one process compiles a graph, the others wait for it and load its entry.

N ranks of one machine that start together would each compile the same graph from scratch (each misses the
cache before any has written it). The first to arrive takes an ``flock`` on a file named by the traced graph's
hash (:func:`graph_key`) in a private folder beside inductor's cache; the others wait (bounded:
``FUNCTRAIN_COMPILE_LOCK_TIMEOUT`` seconds, 600 by default, read by :mod:`functrain.compiler.settings`; then they
compile themselves with a warning), then find the entry the first one wrote. A background compile holds the lock
longer, for as long as its worker compiles (:class:`functrain.compiler.jobs.SharedJob`).
"""
from __future__ import annotations

import contextlib
import hashlib
import os
import threading
import time
import warnings
from typing import Iterator

import torch

from . import cache

__all__ = ["GraphLock", "compile_lock", "graph_key", "held_here"]

# the graph keys this process holds, with how many of its GraphLock objects hold each (only one can: flock)
_HELD_HERE: dict[str, int] = {}
_HERE_LOCK = threading.Lock()


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
        cache.redirect_defaults()  # inductor compiles next: its default folder must be the trusted one by then
        try:
            folder = cache.check_private_folder(os.path.join(cache.inductor_dir(), "functrain-locks"))
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
            with _HERE_LOCK:
                _HELD_HERE[self.key] = _HELD_HERE.get(self.key, 0) + 1
        return True

    def held_elsewhere(self) -> bool:
        """Whether another process holds the lock now (a probe: taken and released at once when free)."""
        if not self.usable or self.held or held_here(self.key):
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
            with _HERE_LOCK:
                left = _HELD_HERE.pop(self.key, 1) - 1
                if left:
                    _HELD_HERE[self.key] = left

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


def held_here(key: str) -> bool:
    """Whether a :class:`GraphLock` of this process holds graph ``key``'s lock now. A flock taken on a second open
    file of the same lock waits for the first even in the same process, so :func:`compile_lock` asks this first: a
    step compiled on the training thread while a background job of the same graph still holds the lock (a job that
    outlived its runner: a test, a notebook cell) waited the lock's whole timeout (600 s) for itself."""
    with _HERE_LOCK:
        return _HELD_HERE.get(key, 0) > 0


@contextlib.contextmanager
def compile_lock(key: str, timeout: float) -> Iterator[bool]:
    """Hold the machine-wide lock on graph ``key`` while compiling it (yields whether it is held).

    Another process holding it is waited for, at most ``timeout`` seconds
    (``FUNCTRAIN_COMPILE_LOCK_TIMEOUT``, read by :mod:`functrain.compiler.settings`); after that this one
    compiles anyway (a warning says so). Without ``fcntl`` (Windows) or a writable lock folder there is no
    lock: each process compiles itself.
    """
    if held_here(key):  # this process holds it already (a background job of the same graph, one that outlived
        yield False     # its runner): a flock on a second file of the same process would wait for itself
        return
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
