"""``ft.launch``: run a function on N local processes that form one process group (notebooks, tests).

For scripts and clusters use ``python -m functrain.launch`` (torchrun underneath, :mod:`functrain.distributed.cli`).
"""
from __future__ import annotations

import contextlib
import io
import multiprocessing as mp
import os
import pickle
import queue
import socket
import sys
import time
import traceback
from typing import Any, Callable, Iterator

from ..core.validate import check_int, check_real, describe
from .faults import RankEnd, cause_of, describe_end, die_with_parent, root_cause

__all__ = ["launch", "free_port", "LaunchError"]


class LaunchError(RuntimeError):
    """A launched rank failed, or the job did not finish in time."""


_SAFE_PATH = "PYTHONSAFEPATH"
_NO_MAIN_GUARD = 87  # a rank's exit status when its start re-ran an unguarded ft.launch call (see _refuse_in_start)


@contextlib.contextmanager
def _safe_path(add: bool) -> Iterator[None]:
    """While the ranks start, ``PYTHONSAFEPATH=1`` (Python >= 3.11): they import nothing from the current folder.

    multiprocessing starts each process (and its resource tracker) as ``python -c 'from multiprocessing.spawn
    import spawn_main; ...'``, and ``-c`` puts the current folder first on ``sys.path``: a ``multiprocessing/``
    another user planted in a folder they can write would run as you before the process takes this process's
    ``sys.path`` (from which it then imports functrain, as this process did). The variable is set in
    ``os.environ`` only around the starts (the only way to reach the new interpreter) and removed again in each
    rank, first thing.
    Python 3.10 has no such flag: there, start jobs from a folder only you can write.
    """
    if not add:
        yield
        return
    os.environ[_SAFE_PATH] = "1"
    try:
        yield
    finally:
        os.environ.pop(_SAFE_PATH, None)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(fn: Callable, args: tuple, rank: int, nprocs: int, port: int, backend: str | None,
            results: Any, env: dict, parent: int, safe_path_added: bool = False) -> None:
    die_with_parent(parent)  # first: a SIGKILLed caller must not leave this rank running
    if safe_path_added:  # set by launch() for this process's start only: not for the processes fn starts
        os.environ.pop(_SAFE_PATH, None)
    os.environ.update(env)
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(nprocs), "LOCAL_RANK": str(rank),
                       "LOCAL_WORLD_SIZE": str(nprocs), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    try:
        import torch.distributed as dist

        from . import group as distributed

        distributed.init(backend)
        try:
            value = fn(*args)
            done_at = time.time()  # before the group goes down: a peer still in a collective fails after this
            value = _pack(value, rank)
        except BaseException as e:  # report before the group goes down, so this rank's error arrives first
            _report_failure(results, rank, e)
            raise SystemExit(1) from None
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
        results.put((rank, True, value, None, None, done_at))
    except SystemExit:
        raise
    except BaseException as e:  # noqa: BLE001 - every failure goes back to the caller
        _report_failure(results, rank, e)


def _pack(value: Any, rank: int) -> bytes:
    """``value`` as plain bytes (``torch.save``): its tensors travel as their data, on the CPU. (Through the queue
    as they are, torch would pass a tensor as a handle to this process's shared memory, which is gone by the time
    the caller reads it once this process has exited: a ``FileNotFoundError`` there.)"""
    import torch

    buffer = io.BytesIO()
    try:
        torch.save(value, buffer, pickle_protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as e:  # noqa: BLE001 - named for the caller, the cause chained
        raise TypeError(f"launch: the value fn returned on rank {rank} cannot be sent back to the caller "
                        f"({type(e).__name__}: {e}); return picklable values (tensors come back on the CPU)") from e
    return buffer.getvalue()


def _unpack(data: bytes, rank: int) -> Any:
    """What :func:`_pack` made of rank ``rank``'s value, its tensors on the CPU (pickles of this job's own ranks)."""
    import torch

    try:
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=False)
    except Exception as e:  # noqa: BLE001 - e.g. a class the rank's value holds that this process cannot import
        raise LaunchError(f"launch: the value rank {rank} returned cannot be loaded in the calling process "
                          f"({type(e).__name__}: {e})") from e


def _refuse_in_start() -> None:
    """Exit at once if this process is a rank being started, which re-runs the calling script's top level (an
    ``ft.launch`` call without the ``if __name__ == "__main__":`` guard would otherwise start ranks of ranks):
    say so on stderr, and exit with a status the caller recognises."""
    if not getattr(mp.current_process(), "_inheriting", False):  # multiprocessing's own flag for a start
        return
    script = getattr(sys.modules.get("__mp_main__"), "__file__", None) or "the script"
    sys.stderr.write(f"ft.launch: this rank, starting, ran the unguarded ft.launch call of {script} again "
                     f"(no `if __name__ == \"__main__\":` guard); it exits and the caller says why\n")
    sys.stderr.flush()
    raise SystemExit(_NO_MAIN_GUARD)


def _no_guard(script: str) -> str:
    return (f"the script that calls ft.launch ({script}) must guard it with `if __name__ == \"__main__\":`, "
            f"because ft.launch starts each rank by importing that script (multiprocessing's spawn), and each rank "
            f"ran the unguarded call again. Put the ft.launch call, and whatever else should run once, under "
            f"`if __name__ == \"__main__\":` (the function the ranks run stays at the top level)")


def _report_failure(results: Any, rank: int, error: BaseException) -> None:
    tb = traceback.format_exc()
    cause = cause_of(error)
    try:
        results.put((rank, False, error, tb, cause, time.time()))
    except Exception:  # the exception itself does not pickle: send its text
        results.put((rank, False, None, tb, cause, time.time()))


def launch(fn: Callable, nprocs: int = 2, args: tuple = (), *, backend: str | None = None,
           timeout: float = 300.0, dist_timeout: float | None = None, env: dict | None = None) -> list:
    """Run ``fn(*args)`` on ``nprocs`` new processes forming one process group; return their results by rank.

    Each process gets torchrun's variables (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
    ``MASTER_ADDR``/``MASTER_PORT`` on a free port), ``OMP_NUM_THREADS=1`` unless set,
    and joins the group before ``fn`` runs. Nothing waits forever:

    * If a rank raises, the others are stopped and the exception of the rank that
      failed first for its own reason is raised here, with that rank's traceback
      attached (a rank that only lost its connection to a dead peer is not blamed;
      a rank killed by a signal raises :class:`LaunchError` naming it).
    * A rank whose ``fn`` returns while the others still run (it left early: their
      next collective fails without it) is named as the cause, not the peers.
    * A hung rank is found by the collective timeout: a peer waiting for it fails
      after ``dist_timeout`` seconds, and :class:`LaunchError` names the rank that did
      not arrive.
    * A job that runs longer than ``timeout`` seconds is killed (:class:`LaunchError`).
    * The ranks die with the calling process, even if it is SIGKILLed (Linux
      parent-death signal).

    A job of two ranks (each spawned process imports torch: seconds)::

        def work(x):
            import torch, torch.distributed as dist
            t = torch.tensor([x + dist.get_rank()])
            dist.all_reduce(t)
            return int(t)

        ft.launch(work, nprocs=2, args=(10,))   # [21, 21]

    Each rank's return value comes back through ``torch.save`` into bytes: any picklable value, its tensors on
    the CPU (not as handles to the rank's shared memory, which is gone once the rank exits). A script that calls
    ``launch`` must guard the call with ``if __name__ == "__main__":``: each rank starts by importing the script
    (multiprocessing's spawn), and a rank that meets the call again exits at once, :class:`LaunchError` saying why.

    Args:
        fn: the function each rank runs; it and ``args`` must be picklable (a module-level function).
        nprocs: the number of processes, an int >= 1 (default 2).
        args: the positional arguments of ``fn`` (default none).
        backend: the process group's backend (default ``None``: gloo on CPU, NCCL on CUDA).
        timeout: the whole job's limit in seconds, > 0 (default 300).
        dist_timeout: the collective timeout in seconds, > 0 (default ``None``:
            ``$FUNCTRAIN_DIST_TIMEOUT``, else 300); given, it is passed to the ranks as that variable.
        env: more environment variables for the ranks (default ``None``).

    Returns:
        The list of ``fn``'s return values, by rank (tensors on the CPU).

    Raises:
        BadValue: ``nprocs``, ``timeout`` or ``dist_timeout`` out of range (before anything starts).
        TypeError: ``fn`` is not callable, or a rank's value cannot be pickled (the message names the rank).
        LaunchError: a rank was killed, hung, left early, or the job passed ``timeout``; the script's call is
            not guarded by ``if __name__ == "__main__":``.
        Exception: the first failing rank's own exception, re-raised here.

    Example::

        >>> import os, functrain as ft
        >>> ft.launch(os.getenv, nprocs=0, args=("RANK",))
        Traceback (most recent call last):
        ...
        functrain.core.validate.BadValue: launch: nprocs must be an int >= 1; got 0 (int)
    """
    _refuse_in_start()
    check_int("launch: nprocs", nprocs, minimum=1)
    if not callable(fn):
        raise TypeError(f"launch: fn must be callable; got {describe(fn)}")
    timeout = check_real("launch: timeout", timeout, lo=0, lo_open=True)
    child_env = {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), **(env or {})}
    if dist_timeout is not None:
        dist_timeout = check_real("launch: dist_timeout", dist_timeout, lo=0, lo_open=True)
        child_env["FUNCTRAIN_DIST_TIMEOUT"] = f"{dist_timeout:g}"
    ctx = mp.get_context("spawn")
    added = sys.version_info >= (3, 11) and _SAFE_PATH not in os.environ
    with _safe_path(added):  # (the queue may start multiprocessing's resource tracker: a process too)
        results = ctx.Queue()
        port = free_port()
        procs = [ctx.Process(target=_worker, args=(fn, args, r, nprocs, port, backend, results, child_env,
                                                   os.getpid(), added), daemon=True)
                 for r in range(nprocs)]
        for p in procs:
            p.start()
    deadline = time.monotonic() + timeout
    values: dict[int, Any] = {}
    finished: dict[int, float] = {}  # rank -> when its fn returned (a rank that leaves early is to blame)
    errors: dict[int, tuple] = {}  # rank -> (exception or None, traceback text, cause, time)
    ends: list[RankEnd] | None = None

    def receive(wait: float) -> bool:
        try:
            rank, ok, value, tb, cause, when = results.get(timeout=wait)
        except queue.Empty:
            return False
        if ok:
            values[rank] = value
            finished[rank] = when
        else:
            errors[rank] = (value, tb, cause, when)
        return True

    try:
        while len(values) < nprocs:
            receive(0.2)
            dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in values]
            if errors or dead:
                # settle: reports still in the pipe, the rank that failed first (its report may come second),
                # a peer that dies of the same cause a moment later
                settle = time.monotonic() + 2.0
                while time.monotonic() < settle:
                    if receive(0.1):
                        continue
                    if any(e[2] == "own" for e in errors.values()) or not any(p.is_alive() for p in procs):
                        break
                ends = _ends(procs, finished, errors)
                break
            if time.monotonic() > deadline:
                running = [r for r, p in enumerate(procs) if p.is_alive() and r not in values]
                raise LaunchError(f"launch: the job did not finish within timeout={timeout:g} s (ranks done: "
                                  f"{sorted(values)}; still running: {running}); all ranks were killed")
    finally:
        for p in procs:
            p.join(timeout=0.0 if ends is not None or len(values) < nprocs else 5.0)
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(timeout=5.0)
        results.close()
    if ends is not None:
        if any(e.how == "exit" and e.code == _NO_MAIN_GUARD for e in ends):
            main = getattr(sys.modules.get("__main__"), "__file__", None) or "the script"
            raise LaunchError(f"launch: the ranks exited while starting: {_no_guard(main)}")
        known = child_env.get("FUNCTRAIN_DIST_TIMEOUT", os.environ.get("FUNCTRAIN_DIST_TIMEOUT", "300"))
        try:
            known_timeout: float | None = float(known)
        except ValueError:
            known_timeout = None
        _raise(ends, errors, nprocs, known_timeout)
    return [_unpack(values[r], r) for r in range(nprocs)]


def _ends(procs: list, finished: dict, errors: dict) -> list[RankEnd]:
    ends = []
    for r, p in enumerate(procs):
        code = p.exitcode
        if r in errors:
            exc, tb, cause, when = errors[r]
            last = (tb or "").strip().splitlines()
            message = last[-1] if last else f"{type(exc).__name__}: {exc}"
            ends.append(RankEnd(r, "error", cause=cause, time=when, message=message))
        elif r in finished:
            ends.append(RankEnd(r, "done", time=finished[r]))
        elif code is None:
            ends.append(RankEnd(r, "running"))
        elif code < 0:
            ends.append(RankEnd(r, "signal", code=-code, time=time.time()))
        else:
            ends.append(RankEnd(r, "exit", code=code, time=time.time()))
    return ends


def _raise(ends: list[RankEnd], errors: dict, nprocs: int, dist_timeout: float | None) -> None:
    root = root_cause(ends)
    others = [f"rank {e.rank}: {describe_end(e, ends)}" for e in ends if e.rank != root.rank and e.how != "done"]
    tail = ("\nother ranks: " + "; ".join(others)) if others else ""
    if root.how == "error":
        exc, tb, _, _ = errors[root.rank]
        message = f"rank {root.rank} of {nprocs} failed:\n{tb}{tail}"
        if isinstance(exc, BaseException):
            exc.add_note(message)
            raise exc
        raise LaunchError(message)
    message = f"rank {root.rank} of {nprocs} {describe_end(root, ends, dist_timeout)}"
    waiting = [errors[e.rank][1] for e in ends if e.how == "error" and e.rank in errors]
    if waiting:
        message += f"{tail}\nthe first report of another rank:\n{waiting[0]}"
    else:
        message += tail
    raise LaunchError(message)
