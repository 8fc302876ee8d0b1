"""Compile jobs: one graph being compiled somewhere, for :mod:`functrain.compiler.background`.

A job says where its graph stands (:meth:`Job.poll`: ``RUNNING``, ``READY`` or ``FAILED``, a host int the
ranks agree on with a MIN) and, when it was compiled in this process, hands over the code. Kinds: a
worker process (:class:`WorkerJob`, the default: it compiles into the shared on-disk caches, the training
thread loads from them; :class:`SharedJob` makes it one worker per machine), a daemon thread
(:class:`ThreadJob`, for comparison), the training thread itself
(:class:`InlineJob`: backends whose code cannot travel), a cache hit (:class:`LoadedJob`) and a trace that
failed (:class:`FailedJob`). Every job is bounded: ``FUNCTRAIN_COMPILE_TIMEOUT`` seconds (default 3600),
and a worker is killed with its compiler children when its job ends early, when it is garbage-collected
and at exit: nothing of a run outlives it. One opt-in exception (``FUNCTRAIN_COMPILE_FINISH=1``): a job whose
run ended normally (:meth:`WorkerJob.finish_after_exit`, called by ``ft.run`` when its loop completes) is left
to finish at exit, so that the next run finds the code in the caches. The settings come from
:class:`~functrain.compiler.settings.WorkerSettings`, read once by ``ft.compile``: nothing here reads the
environment.

A worker imports functrain and torch only from where this process imported them: it is started with an
explicit ``sys.path`` (this process's, without the current folder or an empty entry, functrain's own folder
first), never as ``python -m``, which would put the current folder first and run whatever another user planted
there.
"""
from __future__ import annotations

import atexit
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from typing import Any, Callable

from .backend import compile_graph
from .capture import Captured
from .settings import WorkerSettings

__all__ = ["Job", "FailedJob", "InlineJob", "LoadedJob", "ThreadJob", "WorkerJob", "SharedJob", "WorkerPool", "TIMEOUT_ENV",
           "FINISH_ENV", "GRACE_ENV", "RUNNING", "READY", "FAILED", "DECLINED", "leads_at_once", "worker_command", "outlives",
           "compile_apart"]

TIMEOUT_ENV = "FUNCTRAIN_COMPILE_TIMEOUT"  # (named in messages; read by compiler.settings only)
FINISH_ENV = "FUNCTRAIN_COMPILE_FINISH"
GRACE_ENV = "FUNCTRAIN_COMPILE_FOLLOW_S"
RUNNING, READY, FAILED = 0, 1, -1  # a job's status, and what the ranks agree on (their MIN)
DECLINED = -2  # (agreed only) a rank's compile policy decided not to compile: no rank compiles


def worker_command(module: str, *args: str) -> list[str]:
    """The command line that runs ``module``'s ``main(argv)`` in a new Python process which imports only from
    this process's ``sys.path``, functrain's own folder first: no empty entry, no current folder (``python -m``
    and ``-c`` put the current folder first, where another user may have planted a ``functrain`` or ``torch``
    package). ``-P`` (Python >= 3.11) keeps it out too; the explicit path does it on 3.10.

    Example::

        >>> cmd = worker_command("functrain.compiler.worker", "1")
        >>> "-m" in cmd, cmd[-2:]
        (False, ['functrain.compiler.worker', '1'])
    """
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    cwd = os.getcwd()
    path = [root] + [p for p in sys.path if p and p != root and os.path.abspath(p) != cwd]
    # it dies with this process from its first line (the kernel's parent-death signal, set before torch is imported:
    # seconds during which it would otherwise outlive a parent killed meanwhile); the module's main refines it
    code = (f"import sys, os\nsys.path[:] = {path!r}\n"
            f"try:\n import ctypes; ctypes.CDLL(None).prctl(1, 9, 0, 0, 0)\nexcept Exception:\n pass\n"
            f"if os.getppid() != {os.getpid()}: os.kill(os.getpid(), 9)\n"
            f"import importlib; sys.exit(importlib.import_module(sys.argv[1]).main(sys.argv[2:]))")
    # (the module's name is an argument of its own: what `ps` shows, and what a test finds the worker by)
    return [sys.executable, *(["-P"] if sys.version_info >= (3, 11) else []), "-c", code, module, *args]


def leads_at_once() -> bool:
    """Whether this process starts compiling a graph as soon as it has traced it (local rank 0, or a process
    that is not one of several ranks: no ``LOCAL_RANK``); the machine's other ranks first wait up to
    ``FUNCTRAIN_COMPILE_FOLLOW_S`` seconds (5 by default) for local rank 0 to start, then load its code."""
    return os.environ.get("LOCAL_RANK", "0").strip() in ("", "0")


class Job:
    """One graph compiling somewhere; :meth:`poll` says ``RUNNING``, ``READY`` or ``FAILED``."""

    status = RUNNING
    source = "here"  # where the code is made (Progress.source)
    reason: str | None = None
    seconds: float | None = None  # the compile itself, where it is known
    cpu_s: float | None = None  # the CPU seconds the compile's process used (a worker's), where it is known
    said = False  # its failure was warned about
    notes: list = []  # what the compile asks to be said (a damaged cache entry it set aside and rebuilt)
    finished: float | None = None  # when the code was ready

    def __init__(self) -> None:
        self.started = time.perf_counter()

    def _ready(self, seconds: float | None) -> int:
        self.finished = time.perf_counter()
        self.seconds = seconds
        self.status = READY
        return READY

    def poll(self) -> int:
        return self.status

    def wait(self) -> int:
        """Block until the job ends (bounded by its timeout); its status."""
        while self.poll() == RUNNING:
            time.sleep(0.02)
        return self.status

    def code(self) -> Callable | None:
        """The compiled callable if it was made in this process, else ``None`` (load it from the caches)."""
        return None

    def close(self) -> None:
        """Stop the job if it still runs."""

    def _fail(self, reason: str) -> int:
        self.status, self.reason = FAILED, reason
        return FAILED


class FailedJob(Job):
    """A graph that will not compile (its trace failed)."""

    def __init__(self, reason: str):
        super().__init__()
        self._fail(reason)


class InlineJob(Job):
    """Compiled on the training thread (a backend whose code cannot travel between processes): at once, or
    (``now=False``: packages, which AOTInductor builds from the real inputs, and graphs that cannot be sent to
    a worker) by the switch itself, which every rank reaches at the same call."""

    def __init__(self, cap: Captured, backend: Any, now: bool = True):
        super().__init__()
        self.fn = None
        try:
            if now:
                self.fn = compile_graph(backend, cap.gm, cap.metas)
        except Exception as e:  # noqa: BLE001 - a failed compile: train on eagerly, say why
            self._fail(f"the backend failed to compile the step: {type(e).__name__}: {_first(e)}")
        else:
            self._ready(time.perf_counter() - self.started)

    def code(self) -> Callable | None:
        return self.fn


class LoadedJob(Job):
    """Loaded from the caches on the training thread (an earlier process compiled the graph)."""

    source = "cache"

    def __init__(self, fn: Callable):
        super().__init__()
        self.fn = fn
        self._ready(0.0)

    def code(self) -> Callable | None:
        return self.fn


class ThreadJob(Job):
    """Compiled in a daemon thread of this process (``FUNCTRAIN_COMPILE_WORKER=thread``: for comparison only)."""

    source = "thread"

    def __init__(self, cap: Captured, backend: Any, settings: WorkerSettings):
        super().__init__()
        self.fn: Callable | None = None
        self.timeout = settings.timeout
        nice = settings.nice
        gm, metas = cap.gm, cap.metas

        def run() -> None:
            try:
                if hasattr(os, "setpriority"):
                    os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
            except OSError:
                pass
            try:
                fn = compile_graph(backend, gm, metas)
            except Exception as e:  # noqa: BLE001
                self._fail(f"the compile thread failed: {type(e).__name__}: {_first(e)}")
            else:
                self.fn = fn
                self._ready(time.perf_counter() - self.started)

        threading.Thread(target=run, name="functrain-compile", daemon=True).start()

    def poll(self) -> int:
        if self.status == RUNNING and time.perf_counter() - self.started > self.timeout:
            return self._fail(f"the compile thread did not finish within {self.timeout:g} s ({TIMEOUT_ENV})")
        return self.status

    def code(self) -> Callable | None:
        return self.fn


_LIVE: "weakref.WeakSet[WorkerJob]" = weakref.WeakSet()
# the jobs a run that ended normally leaves to finish at exit (finish_after_exit): held here, so that dropping the
# runner that made them (a script's loop returning) does not kill them before exit decides
_KEPT: set = set()
_atexit_registered = False


def _kill_tree(proc: subprocess.Popen, files: tuple = ()) -> None:
    """Kill the worker with its compiler children, reap it and close every file this process holds of it (its
    pipes, its log): nothing left to the garbage collector, which would warn (``ResourceWarning``)."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # the worker and its compiler children (its own group)
        except (ProcessLookupError, PermissionError):
            pass
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:  # pragma: no cover - a process that ignores SIGKILL (D state)
        pass
    for f in (proc.stdin, proc.stdout, *files):
        try:
            if f is not None:
                f.close()
        except OSError:  # (a pipe whose feeding thread still writes: closed when the write fails)
            pass


def outlives(job: "WorkerJob") -> bool:
    """The one rule for whether a compile may outlive its process: its worker still compiles, the run that started
    it ended normally (the runner said so: :meth:`WorkerJob.finish_after_exit`), and the settings allow it
    (``FUNCTRAIN_COMPILE_FINISH``)."""
    return job.settings.finish and job.keep and job.status == RUNNING


def _at_exit() -> None:
    """At exit: a worker that :func:`outlives` its process finishes its compile (said once on stderr); every other
    is killed with its compiler children."""
    for job in list(_LIVE):
        if not outlives(job):
            job.close()
        elif job.detach():
            print(f"functrain: the background compile goes on in process {job.pid} (nice +"
                  f"{job.settings.nice}, at most {job.timeout:g} s) after this process "
                  f"exits, so that the next run of this step starts compiled ({FINISH_ENV}=0 stops it at exit "
                  f"instead)", file=sys.stderr, flush=True)
        else:  # (detach killed it) said, since the next run will compile from scratch again
            print(f"functrain: the background compile in process {job.pid} could not be left to finish (it did not "
                  f"answer within 10 s, or it had exited); it was stopped: the next run compiles this step again",
                  file=sys.stderr, flush=True)


class WorkerJob(Job):
    """Compiled by a worker process (:mod:`functrain.compiler.worker`) into the shared caches.

    The process starts with the job object (it imports torch and inductor while this process traces the
    graph); :meth:`send` gives it the graph. A job never sent is closed, and the worker exits or is killed."""

    source = "worker"

    def __init__(self, settings: WorkerSettings):
        global _atexit_registered
        super().__init__()
        self.settings = settings
        self.timeout = timeout = settings.timeout
        self.log = tempfile.TemporaryFile()  # the worker's stderr (no file left behind)
        self.proc = subprocess.Popen(worker_command("functrain.compiler.worker", str(os.getpid()),
                                                    repr(float(timeout)), str(settings.nice)),
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log,
                                     start_new_session=True)
        self.pid = self.proc.pid
        self.sent = False  # the worker has its graph
        self.keep = False  # finish_after_exit(): at exit, let it finish instead of killing it
        _LIVE.add(self)
        if not _atexit_registered:
            atexit.register(_at_exit)
            _atexit_registered = True
        self._finalizer = weakref.finalize(self, _kill_tree, self.proc, (self.log,))
        self._finalizer.atexit = False  # at exit _at_exit decides (kill, or let a completed run's job finish)

    def send(self, payload: bytes) -> None:
        """Give the worker its job (from a thread: a pipe write blocks until the worker reads it)."""

        def feed(stdin: Any = self.proc.stdin) -> None:
            try:
                stdin.write(payload)
                stdin.close()
            except (BrokenPipeError, OSError):
                pass  # the worker died: poll() says how

        self.sent = True
        self._feeder = threading.Thread(target=feed, name="functrain-compile-feed", daemon=True)
        self._feeder.start()

    def finish_after_exit(self, finish: bool = True) -> None:
        """The run that started this compile ended normally: if it still runs at exit, let it finish there (see
        :func:`_at_exit`) rather than kill it, unless the settings say ``finish=False``. A worker with no graph
        yet is closed now. ``finish=False``: killed at exit after all."""
        if not self.sent:
            self.close()
        else:
            self.keep = finish and self.status == RUNNING
            (_KEPT.add if self.keep else _KEPT.discard)(self)

    def detach(self, wait: float = 10.0) -> bool:
        """Ask the running worker to outlive this process and stop watching it: once it has said ``ready`` (it
        handles the signal from then on), ``SIGUSR1``, and it answers ``detached``. ``False`` (and the worker is
        killed) if that did not happen within ``wait`` seconds."""
        import select

        if self.poll() != RUNNING:
            return False
        deadline = time.monotonic() + wait
        fd = self.proc.stdout.fileno()
        said = b""

        def until(word: bytes) -> bool:
            nonlocal said
            while word not in said and time.monotonic() < deadline:
                ready, _, _ = select.select([fd], [], [], max(deadline - time.monotonic(), 0.0))
                chunk = os.read(fd, 4096) if ready else b""
                if ready and not chunk:  # it exited meanwhile
                    return False
                said += chunk
            return word in said

        # the whole graph must be in the pipe before this process exits (the feeding thread dies with it, and a
        # worker that reads half a job fails): the worker reads it once its imports are done
        self._feeder.join(max(deadline - time.monotonic(), 0.0))
        if self._feeder.is_alive() or not until(b"ready\n"):
            self.close()
            return False
        try:
            os.kill(self.pid, signal.SIGUSR1)
        except ProcessLookupError:
            return False
        if not until(b"detached\n"):
            self.close()
            return False
        self._finalizer.detach()
        _LIVE.discard(self)
        _KEPT.discard(self)
        for f in (self.proc.stdin, self.proc.stdout, self.log):  # (the worker goes on: its pipes and log are its)
            try:
                f.close()
            except OSError:
                pass
        return True

    def poll(self) -> int:
        if self.status != RUNNING:
            return self.status
        code = self.proc.poll()
        if code is None:
            if time.perf_counter() - self.started > self.timeout:
                self.close()
                return self._fail(f"the compile worker (pid {self.pid}) did not finish within {self.timeout:g} s "
                                  f"({TIMEOUT_ENV}); it was stopped")
            return RUNNING
        answer = self.proc.stdout.read().decode(errors="replace").strip().splitlines()
        tail = self._log_tail()
        self._finalizer()  # reaped: its pipes and log closed
        _LIVE.discard(self)
        _KEPT.discard(self)
        result = None
        if answer:
            import json
            try:
                result = json.loads(answer[-1])
            except ValueError:
                result = None
        if isinstance(result, dict):
            self.notes = [str(n) for n in result.get("notes") or ()][:10]
        if code == 0 and isinstance(result, dict) and result.get("ok"):
            cpu = result.get("cpu_s")
            self.cpu_s = float(cpu) if isinstance(cpu, (int, float)) and not isinstance(cpu, bool) else None
            return self._ready(float(result.get("seconds") or 0.0))
        if code < 0:
            why = f"was killed by signal {signal.Signals(-code).name}"
        elif isinstance(result, dict) and result.get("error"):
            why = f"failed: {result['error']}"
        else:
            why = f"exited with status {code} without an answer"
        return self._fail(f"the compile worker (pid {self.pid}) {why}{tail}")

    def _log_tail(self) -> str:
        try:
            self.log.seek(0)
            text = self.log.read().decode(errors="replace").strip()
        except (OSError, ValueError):
            return ""
        return f"; its log ends:\n{text[-1500:]}" if text else ""

    def close(self) -> None:
        self._finalizer()  # (once: a later call does nothing)
        _LIVE.discard(self)
        _KEPT.discard(self)


class WorkerPool:
    """The compile workers of one background compiler: at most one *spare* (started before a graph is traced, so
    that it imports torch and inductor meanwhile), taken by the job that compiles the graph (:meth:`take`), or
    closed when no job will (:meth:`release`). A job is given the pool, never a callback into its owner.

    Attributes:
        given: workers given a graph (``Progress.workers``).

    Example::

        >>> from functrain.compiler.jobs import WorkerPool
        >>> from functrain.compiler.settings import WorkerSettings
        >>> pool = WorkerPool(WorkerSettings.from_env())
        >>> pool.spare_pid is None, pool.given
        (True, 0)
        >>> pool.release()  # (nothing to close)
    """

    def __init__(self, settings: WorkerSettings):
        self.settings = settings
        self.given = 0
        self._spare: WorkerJob | None = None

    def warm(self) -> None:
        """Start the spare worker now if there is none."""
        if self._spare is None:
            self._spare = WorkerJob(self.settings)

    @property
    def spare_pid(self) -> int | None:
        """The spare worker's process id, or ``None``."""
        return self._spare.pid if self._spare is not None else None

    def take(self) -> "WorkerJob":
        """A worker for a graph: the spare (no longer spare), or a new one."""
        worker, self._spare = self._spare, None
        self.given += 1
        return worker if worker is not None else WorkerJob(self.settings)

    def release(self) -> None:
        """Close the spare worker, if any (no job will need it)."""
        if self._spare is not None:
            self._spare.close()
            self._spare = None

    def finish_after_exit(self) -> None:
        """The run ended: a spare worker is not left waiting (it has no graph)."""
        self.release()


class SharedJob(Job):
    """One graph compiled once per machine: by a worker this process takes from its pool, or by another process's.

    The graph's machine-wide lock (:class:`~functrain.compiler.graph_lock.GraphLock`) says who compiles. This
    process *leads* by taking it: it holds the lock on the training thread while its worker (taken from ``pool``
    and sent ``payload``, the graph with the lock's key) compiles, and releases it when the worker ends.
    Otherwise it *follows* (and releases the pool's spare: no worker here): each :meth:`poll` (one per step)
    probes the lock; once the process that held it has let it go, :meth:`poll` loads the code from the caches
    (``backend.load``: the training thread's one cache load, which the switch would make anyway) and the job is
    ready, with no worker and no compile here. A follower leads after all when the lock is free and the caches
    miss: the other process failed or was killed, or (a rank other than local rank 0, which waits ``grace``
    seconds for local rank 0 to start) nobody started.
    """

    def __init__(self, lock: Any, cap: Captured, backend: Any, pool: WorkerPool, payload: bytes, lead: bool,
                 grace: float, timeout: float):
        super().__init__()
        self.lock, self.cap, self.backend, self.pool, self.payload = lock, cap, backend, pool, payload
        self.timeout = timeout
        self.inner: Job | None = None  # this process's worker, when it leads
        self.fn: Callable | None = None
        self.seen_held = False  # another process was seen holding the lock: its result is worth a load
        # (without a usable lock nobody can be followed: compile at once)
        self._lead_at = self.started + (0.0 if lead or not lock.usable else grace)
        if lead:
            self._lead()
        if self.inner is None:  # another process compiles it: no worker here
            pool.release()

    @property
    def source(self) -> str:  # type: ignore[override]
        """``"worker"`` when this process's worker compiles the graph, ``"peer"`` while it follows another's."""
        return self.inner.source if self.inner is not None else "peer"

    @property
    def pid(self) -> int | None:
        """The process id of this process's worker, or ``None`` (a follower)."""
        return getattr(self.inner, "pid", None)

    def _lead(self) -> None:
        if not self.lock.acquire():
            self.seen_held = True  # another process took it first: follow it
            return
        self.inner = self.pool.take()
        self.inner.send(self.payload)

    def poll(self) -> int:
        if self.status != RUNNING:
            return self.status
        if self.inner is not None:
            status = self.inner.poll()
            if status != RUNNING:
                self.lock.release()
                self.status, self.reason, self.seconds, self.finished, self.notes = \
                    status, self.inner.reason, self.inner.seconds, self.inner.finished, self.inner.notes
            return status
        if time.perf_counter() - self.started > self.timeout:
            return self._fail(f"the process compiling this graph on this machine did not finish within "
                              f"{self.timeout:g} s ({TIMEOUT_ENV})")
        if self.lock.held_elsewhere():
            self.seen_held = True
            return RUNNING
        if self.seen_held:
            try:
                self.fn = self.backend.load(self.cap.gm, self.cap.metas)
            except Exception:  # noqa: BLE001 - the other process failed or died: compile it here
                self.seen_held = False
                self._lead_at = 0.0
            else:
                return self._ready(None)
        if time.perf_counter() >= self._lead_at:
            self._lead()
            return self.poll() if self.inner is not None else RUNNING
        return RUNNING

    def code(self) -> Callable | None:
        return self.fn if self.inner is None else self.inner.code()

    def finish_after_exit(self, finish: bool = True) -> None:
        """See :meth:`WorkerJob.finish_after_exit` (a follower has nothing running); a job left to finish keeps its
        graph's lock until exit."""
        if isinstance(self.inner, WorkerJob):
            self.inner.finish_after_exit(finish)
            (_KEPT.add if self.inner.keep else _KEPT.discard)(self)

    def close(self) -> None:
        if self.inner is not None:
            self.inner.close()
        self.lock.close()
        _KEPT.discard(self)


def compile_apart(cap: Captured, backend: Any, settings: WorkerSettings,
                  inductor: dict) -> tuple[Callable | None, float]:
    """Compile ``cap`` now in a worker process and load its code here (what :meth:`functrain.CompiledStep.precompile`
    does on the direct path with inductor): the caller waits, as for a compile on its own thread, but the compile's
    processes are the worker's process group, which dies with the caller, its C++ compilers included, even if the
    caller is SIGKILLed (a compile on the caller's thread would leave its ``g++`` running). Returns the code and the
    worker's CPU seconds (its compilers' included); ``(None, 0.0)`` for a graph torch cannot serialize (the caller
    compiles it on its thread). Raises ``RuntimeError`` with the worker's reason if the compile failed."""
    from .backend import fake_inputs
    from .graph_lock import graph_key
    from .worker import job_payload

    try:
        # the worker compiles without waiting for the graph's machine-wide lock: the caller may hold it itself (its
        # runner's background job of the same graph), and the caller waits for this worker alone (a wait there
        # deadlocked until FUNCTRAIN_COMPILE_LOCK_TIMEOUT: Trainer.precompile after a declined run)
        payload = job_payload(cap.gm, cap.metas, inductor, lock=graph_key(cap.gm, fake_inputs(cap.metas)),
                              lock_timeout=settings.lock_timeout)
    except Exception:  # noqa: BLE001 - a graph torch cannot serialize: the caller's thread compiles it
        return None, 0.0
    job = WorkerJob(settings)
    try:
        job.send(payload)
        if job.wait() != READY:
            raise RuntimeError(f"ft.compile: the compile failed: {job.reason}")
    finally:
        job.close()
    return backend.load(cap.gm, cap.metas), job.cpu_s or 0.0


def _first(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0][:500] if text else type(error).__name__
