"""Child processes that leave nothing behind: a rank, or a compile worker, dies with its parent.

Kept in the core because both the launchers (:mod:`functrain.distributed.spawn`,
:mod:`functrain.distributed.cli`) and the compiler's background worker
(:mod:`functrain.compiler.worker`) start processes that must not outlive their parent.
"""
from __future__ import annotations

import os
import signal
import sys
import threading

__all__ = ["die_with_parent", "outlive_parent"]

_PR_SET_PDEATHSIG = 1
_watching = [False]  # the watchdog of die_with_parent runs (where prctl is missing) until outlive_parent()


def die_with_parent(parent_pid: int | None = None) -> str:
    """Make this process die (SIGKILL) when its parent dies; return how: ``"prctl"`` or ``"watchdog"``.

    On Linux the kernel's parent-death signal (``prctl(PR_SET_PDEATHSIG)``) does
    it, even when the parent is SIGKILLed. If the parent already died before the
    call (the race between start and ``prctl``), ``os.getppid()`` no longer is
    ``parent_pid`` and the process exits at once. Elsewhere a daemon thread polls
    ``os.getppid()`` once a second. A rank that outlives its launcher would go on
    writing checkpoints that a relaunch then races with.

    Example::

        die_with_parent(int(os.environ["FUNCTRAIN_LAUNCHER_PID"]))   # first thing in a worker
    """
    parent = os.getppid() if parent_pid is None else int(parent_pid)
    how = "watchdog"
    if sys.platform.startswith("linux"):
        try:
            import ctypes

            libc = ctypes.CDLL(None, use_errno=True)
            if libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) == 0:
                how = "prctl"
        except (OSError, AttributeError):
            pass
    if os.getppid() != parent:  # the parent is gone already: the signal will never come
        os.kill(os.getpid(), signal.SIGKILL)
    if how == "watchdog":
        _watching[0] = True

        def watch() -> None:
            import time

            while os.getppid() == parent:
                time.sleep(1.0)
            if _watching[0]:
                os.kill(os.getpid(), signal.SIGKILL)

        threading.Thread(target=watch, name="functrain-parent-watchdog", daemon=True).start()
    return how


def outlive_parent() -> None:
    """Undo :func:`die_with_parent`: this process goes on when its parent exits.

    For a compile worker whose parent ended its run normally and asked it to finish (so the
    next run finds the compiled code in the caches); a parent killed before asking still
    takes the worker with it.
    """
    _watching[0] = False
    if sys.platform.startswith("linux"):
        try:
            import ctypes

            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, 0, 0, 0, 0)
        except (OSError, AttributeError):
            pass
