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
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
import traceback
from typing import Any, Callable, Iterator

from ..core.validate import check_int, check_real, describe
from .faults import (STOP_REPORT, RankEnd, cause_of, describe_end, die_with_parent, lost_steps, read_stop_reports,
                     root_cause)

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


AT_ONCE_S = 3.0  # after a second Ctrl-C: how long the ranks get to say what is lost before they are killed


class _Interrupts:
    """Ctrl-C (SIGINT) to the process that called :func:`launch` while its ranks run, passed on to the ranks.

    A notebook's interrupt and a terminal's Ctrl-C reach the caller (the ranks lead process groups of their own,
    so they are not signalled twice). Without this the caller raised ``KeyboardInterrupt`` where it waited and
    killed the ranks: an ``ft.Trainer`` never got to save. Here the first Ctrl-C is sent to every rank still
    running (a Trainer stops every rank at the same step and saves it; a function without a handler raises
    ``KeyboardInterrupt`` there) and the caller waits for them as before; a second is sent on too (a Trainer
    then stops at once and says what is lost) and the ranks still running ``AT_ONCE_S`` seconds later are
    killed; a third kills them at once. In place only where Python's own Ctrl-C handler is (the main thread,
    no handler of the user's): elsewhere the caller's Ctrl-C behaves as it did.
    """

    def __init__(self) -> None:
        self.count = 0  # Ctrl-Cs that came
        self.passed = 0  # ... of them passed on
        self.killed: list[int] = []  # ranks killed after a second or third Ctrl-C
        self._kill_at: float | None = None
        self._previous: Any = None

    def __enter__(self) -> "_Interrupts":
        if (threading.current_thread() is threading.main_thread()
                and signal.getsignal(signal.SIGINT) is signal.default_int_handler):
            self._previous = signal.signal(signal.SIGINT, self._note)
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)
            self._previous = None

    def _note(self, signum: int, frame: Any) -> None:
        self.count += 1  # (only noted: the waiting loop passes it on, never a handler in the middle of a read)

    def pass_on(self, procs: list, returned: dict) -> None:
        """Send the Ctrl-Cs that came since the last call to the ranks that have not returned; kill them once the
        time a second Ctrl-C gives them is over."""
        running = [(r, p) for r, p in enumerate(procs) if p.is_alive() and r not in returned]
        while self.passed < self.count:
            self.passed += 1
            if self.passed == 1:
                _say(f"ft.launch: Ctrl-C: passed on to rank(s) {', '.join(str(r) for r, _ in running)} (an "
                     f"ft.Trainer stops every rank at the same step and saves it); Ctrl-C again stops them at once")
            if self.passed <= 2:
                for _, p in running:
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.kill(p.pid, signal.SIGINT)
                if self.passed == 2:
                    self._kill_at = time.monotonic() + AT_ONCE_S
            else:
                self._kill_at = time.monotonic()
        if self._kill_at is not None and time.monotonic() >= self._kill_at:
            for r, p in running:
                p.kill()
                self.killed.append(r)
            self._kill_at = None


def _say(line: str) -> None:
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


def _after_interrupt(interrupts: _Interrupts, ends: list[RankEnd] | None, errors: dict, reports: dict,
                     nprocs: int) -> None:
    """After a Ctrl-C was passed on and the ranks ended: say how (one line on stderr) and raise
    ``KeyboardInterrupt`` if they stopped without returning; return if every rank returned (a Trainer that saved:
    the caller gets its values, as ``train()`` returns after a Ctrl-C on one process). A rank that failed for a
    reason of its own is left to :func:`launch`'s usual report."""
    saved = {r: rep for r, rep in reports.items() if rep.get("saved") is True}
    if ends is None:
        steps = sorted({rep.get("checkpoint_step") for rep in saved.values()}, key=str)
        if len(saved) == nprocs and len(steps) == 1:
            path = next(iter(saved.values())).get("checkpoint")
            _say(f"ft.launch: stopped by Ctrl-C; every rank saved step {steps[0]} ({path}) and returned")
        elif saved:
            _say("ft.launch: stopped by Ctrl-C; every rank returned; the ranks saved different steps ("
                 + ", ".join(f"rank {r}: step {rep.get('checkpoint_step')}" for r, rep in sorted(saved.items()))
                 + ")")
        else:
            _say("ft.launch: stopped by Ctrl-C; every rank returned (none said it saved a checkpoint; an "
                 "ft.Trainer does)")
        return

    def interrupted(end: RankEnd) -> bool:
        if end.how == "signal":
            return end.code in (int(signal.SIGINT), int(signal.SIGKILL))
        if end.how == "error":
            exc = errors[end.rank][0]
            return isinstance(exc, KeyboardInterrupt) or errors[end.rank][2] != "own" or (
                exc is None and "KeyboardInterrupt" in (errors[end.rank][1] or ""))
        return end.how in ("done", "running")

    if not all(interrupted(e) for e in ends):
        return  # a failure of a rank's own: launch() raises it as usual
    parts = []
    if interrupts.passed >= 2:
        parts.append("a second Ctrl-C stopped the ranks at once, without waiting for them to save")
    at_once = sorted(r for r, rep in reports.items() if rep.get("how") == "at_once" and r not in saved)
    if at_once:
        at = sorted({reports[r].get("step") for r in at_once if isinstance(reports[r].get("step"), int)})
        parts.append(f"rank(s) {', '.join(map(str, at_once))} stopped without saving"
                     + (f" at step {', '.join(map(str, at))}" if at else ""))
    keyboard = sorted(e.rank for e in ends if e.how == "error" and (isinstance(errors[e.rank][0], KeyboardInterrupt)
                                                                   or "KeyboardInterrupt" in (errors[e.rank][1] or "")))
    if keyboard:
        parts.append(f"rank(s) {', '.join(map(str, keyboard))} raised KeyboardInterrupt (the Ctrl-C came where the "
                     f"function does not handle it, e.g. before ft.Trainer's loop)")
    if interrupts.killed:
        parts.append(f"rank(s) {', '.join(map(str, sorted(interrupts.killed)))} were killed")
    known = [rep for rep in reports.values() if isinstance(rep.get("checkpoint_step"), int)]
    if len(saved) == nprocs and len({rep.get("checkpoint_step") for rep in saved.values()}) == 1:
        rep = next(iter(saved.values()))
        tail = f": the checkpoint of step {rep['checkpoint_step']} is written ({rep.get('checkpoint')})"
    elif known:
        newest = max(known, key=lambda rep: rep["checkpoint_step"])
        done = max((rep.get("step") for rep in reports.values() if isinstance(rep.get("step"), int)),
                   default=newest["checkpoint_step"])
        tail = (f": the last checkpoint is step {newest['checkpoint_step']} ({newest.get('checkpoint')}); "
                f"{lost_steps(newest['checkpoint_step'], done)}")
    else:
        tail = ": no checkpoint of the stop is written"
    message = f"ft.launch: stopped by Ctrl-C; {'; '.join(parts) or 'the ranks ended'}{tail}"
    _say(message)
    raise KeyboardInterrupt(message)


def _worker(fn: Callable, args: tuple, rank: int, nprocs: int, port: int, backend: str | None,
            results: Any, env: dict, parent: int, safe_path_added: bool = False) -> None:
    die_with_parent(parent)  # first: a SIGKILLed caller must not leave this rank running
    with contextlib.suppress(OSError):
        # a process group of its own (as torchrun starts each rank): a terminal's Ctrl-C, or a notebook's interrupt
        # sent to the caller's group, reaches the caller only, which passes it on exactly once (_Interrupts)
        os.setpgid(0, 0)
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
    * Ctrl-C (a notebook's interrupt, a terminal's) is passed on to the ranks, as
      ``python -m functrain.launch`` does: an ``ft.Trainer`` stops every rank at the
      same step, saves it and returns, and so does ``launch`` (its values; a line on
      stderr names the checkpoint). A second Ctrl-C stops the ranks at once
      (``KeyboardInterrupt`` here, its message naming the last checkpoint and the steps
      lost); ranks that do not handle Ctrl-C end with ``KeyboardInterrupt``, raised here.

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
        KeyboardInterrupt: a Ctrl-C stopped the ranks before they returned (the message says what is saved).
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
    stops = tempfile.mkdtemp(prefix="functrain-launch-")  # where each rank says how a Ctrl-C stop ended for it
    child_env[STOP_REPORT] = stops
    try:
        with _Interrupts() as interrupts:
            return _run(fn, args, nprocs, backend, timeout, child_env, interrupts, stops)
    finally:
        shutil.rmtree(stops, ignore_errors=True)


def _run(fn: Callable, args: tuple, nprocs: int, backend: str | None, timeout: float, child_env: dict,
         interrupts: "_Interrupts", stops: str) -> list:
    """:func:`launch` once its arguments are checked: start the ranks, wait for them, pass Ctrl-C on."""
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
            interrupts.pass_on(procs, values)
            receive(0.2)
            dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in values]
            if errors or dead:
                # settle: reports still in the pipe, the rank that failed first (its report may come second),
                # a peer that dies of the same cause a moment later
                settle = time.monotonic() + 2.0
                while time.monotonic() < settle:
                    interrupts.pass_on(procs, values)
                    if receive(0.1):
                        continue
                    # (after a Ctrl-C every rank has its own KeyboardInterrupt to report: wait for all of them)
                    if ((not interrupts.passed and any(e[2] == "own" for e in errors.values()))
                            or not any(p.is_alive() for p in procs)):
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
        # nothing of the queue stays referenced from this frame (and the processes' arguments): an exception's
        # traceback keeps the frame, and its semaphores would then be reported leaked when the interpreter exits
        del receive, results
        procs.clear()
    if interrupts.count:
        _after_interrupt(interrupts, ends, errors, read_stop_reports(stops), nprocs)
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
